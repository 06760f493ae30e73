"""The JSON schemas of `bench structured`, each with the natural-language request a user would send for it.

From a flat object of two fields to nested objects, arrays with minItems/maxItems, enums, bounded integers and
numbers, optional fields, booleans, strings with maxLength or a pattern, and anyOf. Every schema is written so that a
completion that follows it must end: strings have a maxLength, a pattern or an enum, arrays a maxItems, integers
bounds, objects `additionalProperties: false` (otherwise a grammar allows any number of extra keys), and numbers a
binary `multipleOf` (0.5, 0.25: exact in floating point, so `jsonschema` judges them right) or, for a few, only
bounds (their digits are not bounded, so a small greedy model may loop inside one until max_tokens: that is a
'length' finish, counted as a miss). Simple schemas come first, so `--schemas N` takes the N simplest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cortexstream.errors import InvalidArgumentError

ANSWER = "Reply with only the JSON, no other text."


def text(most: int, least: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": least, "maxLength": most}


def pattern(regex: str) -> dict[str, Any]:
    return {"type": "string", "pattern": regex}


def whole(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def real(lo: float, hi: float, step: float | None = None) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi, **({"multipleOf": step} if step else {})}


def choice(*values: Any) -> dict[str, Any]:
    return {"enum": list(values)}


def flag() -> dict[str, Any]:
    return {"type": "boolean"}


def items(item: dict[str, Any], least: int, most: int) -> dict[str, Any]:
    return {"type": "array", "items": item, "minItems": least, "maxItems": most}


def obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": {**required, **(optional or {})}, "required": list(required),
            "additionalProperties": False}


def either(*schemas: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": list(schemas)}


DATE = pattern(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")
CLOCK = pattern(r"^[0-2][0-9]:[0-5][0-9]$")
CURRENCY = pattern(r"^[A-Z]{3}$")


@dataclass(frozen=True)
class SchemaCase:
    name: str
    prompt: str  # what the user asks for, in words (the field names and limits included)
    schema: dict[str, Any]

    def __post_init__(self) -> None:
        if not self.name or not self.prompt:
            raise InvalidArgumentError(f"SchemaCase: name and prompt must be non-empty (got {self.name!r})")
        if not isinstance(self.schema, dict):
            raise InvalidArgumentError(f"SchemaCase {self.name}: schema must be a dict")

    def messages(self) -> list[dict[str, str]]:
        """The chat the model gets (its own chat template renders it)."""
        return [{"role": "user", "content": f"{self.prompt} {ANSWER}"}]


def _c(name: str, prompt: str, schema: dict[str, Any]) -> SchemaCase:
    return SchemaCase(name, prompt, schema)


SCHEMA_CASES: tuple[SchemaCase, ...] = (
    _c("yes_no", "Is the Pacific the largest ocean? Give JSON with a boolean field answer.", obj({"answer": flag()})),
    _c("color", "Name a primary color as JSON with field color, one of red, yellow or blue.",
       obj({"color": choice("red", "yellow", "blue")})),
    _c("dice", "Roll a die: JSON with field roll, an integer from 1 to 6.", obj({"roll": whole(1, 6)})),
    _c("greeting", "Write a greeting as JSON with field text (at most 30 characters).", obj({"text": text(30)})),
    _c("sentiment", "Classify the sentiment of 'I loved this film!' as JSON with field label (positive, negative or "
       "neutral) and confidence (a number from 0 to 1 in steps of 0.25).",
       obj({"label": choice("positive", "negative", "neutral"), "confidence": real(0, 1, 0.25)})),
    _c("person", "Describe a fictional person as JSON with name (at most 20 characters) and age (integer 0 to 120).",
       obj({"name": text(20), "age": whole(0, 120)})),
    _c("temperature", "Give today's temperature in Paris as JSON with celsius (a number from -30 to 45, steps of "
       "0.5) and unit, which is \"C\".", obj({"celsius": real(-30, 45, 0.5), "unit": choice("C")})),
    _c("country_code", "Give France's ISO country code as JSON with field code: two capital letters.",
       obj({"code": pattern(r"^[A-Z]{2}$")})),
    _c("math", "What is 7 times 8? Answer as JSON with field result, an integer from 0 to 1000.",
       obj({"result": whole(0, 1000)})),
    _c("currency_pair", "Give a currency pair as JSON with base and quote, each a three-letter capital currency "
       "code like USD.", obj({"base": CURRENCY, "quote": CURRENCY})),
    _c("date", "Give the date of the first Moon landing as JSON with field date in YYYY-MM-DD form.",
       obj({"date": DATE})),
    _c("alarm", "Set an alarm as JSON with time in HH:MM 24-hour form and enabled, a boolean.",
       obj({"time": CLOCK, "enabled": flag()})),
    _c("tags", "Give 1 to 3 tags for a blog post about baking bread as JSON with field tags, an array of strings "
       "of at most 15 characters.", obj({"tags": items(text(15), 1, 3)})),
    _c("scores", "Give three test scores as JSON with field scores, an array of exactly 3 integers from 0 to 100.",
       obj({"scores": items(whole(0, 100), 3, 3)})),
    _c("animal", "Describe an animal as JSON with name (at most 20 characters), legs (integer 0 to 8) and "
       "can_fly (boolean).", obj({"name": text(20), "legs": whole(0, 8), "can_fly": flag()})),
    _c("book", "Describe a famous novel as JSON with title (at most 40 characters), author (at most 30 "
       "characters), year (integer 1500 to 2024) and optionally pages (integer 10 to 2000).",
       obj({"title": text(40), "author": text(30), "year": whole(1500, 2024)}, {"pages": whole(10, 2000)})),
    _c("movie_rating", "Rate the movie Inception as JSON with title (at most 30 characters), stars (a number from 0 "
       "to 5 in steps of 0.5) and recommend (boolean).",
       obj({"title": text(30), "stars": real(0, 5, 0.5), "recommend": flag()})),
    _c("weekday", "Which day comes after Friday? JSON with field day, one of the seven weekday names in English, "
       "capitalized.", obj({"day": choice("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday",
                                          "Sunday")})),
    _c("priority_task", "Create a to-do item as JSON with title (at most 40 characters), priority (low, medium or "
       "high) and done (boolean).", obj({"title": text(40), "priority": choice("low", "medium", "high"),
                                         "done": flag()})),
    _c("coordinates", "Give the latitude and longitude of Tokyo as JSON with lat (number from -90 to 90) and lon "
       "(number from -180 to 180).", obj({"lat": real(-90, 90), "lon": real(-180, 180)})),
    _c("id_or_name", "Identify a user as JSON with field user, which is either an integer id from 1 to 99999 or a "
       "username of at most 16 characters.", obj({"user": either(whole(1, 99999), text(16))})),
    _c("product", "Describe a product as JSON with name (at most 30 characters), price (number 0 to 10000 in "
       "steps of 0.25), in_stock (boolean) and optionally category (electronics, books, toys or food).",
       obj({"name": text(30), "price": real(0, 10000, 0.25), "in_stock": flag()},
           {"category": choice("electronics", "books", "toys", "food")})),
    _c("address", "Give a postal address as JSON with street (at most 40 characters), city (at most 25 "
       "characters), zip (5 digits) and country (at most 25 characters).",
       obj({"street": text(40), "city": text(25), "zip": pattern(r"^[0-9]{5}$"), "country": text(25)})),
    _c("rgb", "Give the RGB values of orange as JSON with r, g and b, each an integer from 0 to 255.",
       obj({"r": whole(0, 255), "g": whole(0, 255), "b": whole(0, 255)})),
    _c("hex_color", "Give a color as JSON with name (at most 15 characters) and hex, a # followed by six hex "
       "digits in lower case.", obj({"name": text(15), "hex": pattern(r"^#[0-9a-f]{6}$")})),
    _c("shopping_list", "Make a shopping list of 2 to 5 items as JSON with field items, each an object with name "
       "(at most 20 characters) and quantity (integer 1 to 20).",
       obj({"items": items(obj({"name": text(20), "quantity": whole(1, 20)}), 2, 5)})),
    _c("planet", "Describe Mars as JSON with name (at most 10 characters), moons (integer 0 to 100), has_rings "
       "(boolean) and type (terrestrial or gas giant or ice giant).",
       obj({"name": text(10), "moons": whole(0, 100), "has_rings": flag(),
            "type": choice("terrestrial", "gas giant", "ice giant")})),
    _c("contact", "Give a contact as JSON with name (at most 25 characters) and method, which is either an object "
       "with email (at most 40 characters) or an object with phone (digits and dashes, at most 15 characters).",
       obj({"name": text(25), "method": either(obj({"email": text(40)}),
                                               obj({"phone": pattern(r"^[0-9-]{7,15}$")}))})),
    _c("event", "Create a calendar event as JSON with title (at most 40 characters), date (YYYY-MM-DD), start "
       "(HH:MM) and optionally duration_minutes (integer 5 to 480).",
       obj({"title": text(40), "date": DATE, "start": CLOCK}, {"duration_minutes": whole(5, 480)})),
    _c("employee", "Describe an employee as JSON with name (at most 25 characters), department (engineering, "
       "sales, marketing or support), salary (integer 20000 to 300000) and remote (boolean).",
       obj({"name": text(25), "department": choice("engineering", "sales", "marketing", "support"),
            "salary": whole(20000, 300000), "remote": flag()})),
    _c("flight", "Describe a flight as JSON with number (two capital letters then 1 to 4 digits), origin and "
       "destination (three capital letters each, airport codes), and departure (HH:MM).",
       obj({"number": pattern(r"^[A-Z]{2}[0-9]{1,4}$"), "origin": pattern(r"^[A-Z]{3}$"),
            "destination": pattern(r"^[A-Z]{3}$"), "departure": CLOCK})),
    _c("recipe", "Give a pancake recipe as JSON with name (at most 30 characters), servings (integer 1 to 12) and "
       "ingredients, 2 to 8 strings of at most 30 characters each.",
       obj({"name": text(30), "servings": whole(1, 12), "ingredients": items(text(30), 2, 8)})),
    _c("weather_report", "Give a weather report as JSON with city (at most 25 characters), condition (sunny, "
       "cloudy, rainy or snowy), high and low (integers from -40 to 50) and optionally wind_kph (integer 0 to "
       "200).", obj({"city": text(25), "condition": choice("sunny", "cloudy", "rainy", "snowy"),
                     "high": whole(-40, 50), "low": whole(-40, 50)}, {"wind_kph": whole(0, 200)})),
    _c("invoice_line", "Give an invoice line as JSON with sku (three capital letters, a dash, four digits), "
       "description (at most 40 characters), quantity (integer 1 to 1000) and unit_price (number 0 to 5000 in "
       "steps of 0.25).", obj({"sku": pattern(r"^[A-Z]{3}-[0-9]{4}$"), "description": text(40),
                               "quantity": whole(1, 1000), "unit_price": real(0, 5000, 0.25)})),
    _c("song", "Describe a song as JSON with title (at most 30 characters), artist (at most 30 characters), "
       "duration_seconds (integer 30 to 900) and explicit (boolean).",
       obj({"title": text(30), "artist": text(30), "duration_seconds": whole(30, 900), "explicit": flag()})),
    _c("poll", "Create a poll as JSON with question (at most 60 characters) and options, 2 to 4 strings of at "
       "most 20 characters, and multiple_choice (boolean).",
       obj({"question": text(60), "options": items(text(20), 2, 4), "multiple_choice": flag()})),
    _c("bug_report", "File a bug report as JSON with title (at most 50 characters), severity (minor, major or "
       "critical), steps (1 to 4 strings of at most 40 characters) and optionally version (like 1.2.3).",
       obj({"title": text(50), "severity": choice("minor", "major", "critical"), "steps": items(text(40), 1, 4)},
           {"version": pattern(r"^[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}$")})),
    _c("measurement", "Report a sensor reading as JSON with sensor (at most 20 characters) and value, either a "
       "number from -100 to 100 in steps of 0.5 or the string \"offline\".",
       obj({"sensor": text(20), "value": either(real(-100, 100, 0.5), choice("offline"))})),
    _c("restaurant_review", "Review a restaurant as JSON with name (at most 30 characters), cuisine (at most 20 "
       "characters), rating (integer 1 to 5), price_level (one of $, $$, $$$) and optionally comment (at most 80 "
       "characters).", obj({"name": text(30), "cuisine": text(20), "rating": whole(1, 5),
                            "price_level": choice("$", "$$", "$$$")}, {"comment": text(80)})),
    _c("workout", "Plan a workout as JSON with day (YYYY-MM-DD) and exercises, 1 to 4 objects each with name (at "
       "most 20 characters), sets (integer 1 to 10) and reps (integer 1 to 50).",
       obj({"day": DATE, "exercises": items(obj({"name": text(20), "sets": whole(1, 10), "reps": whole(1, 50)}),
                                            1, 4)})),
    _c("student", "Describe a student as JSON with name (at most 25 characters), grade (integer 1 to 12) and "
       "courses, 1 to 4 objects each with subject (at most 20 characters) and score (integer 0 to 100).",
       obj({"name": text(25), "grade": whole(1, 12),
            "courses": items(obj({"subject": text(20), "score": whole(0, 100)}), 1, 4)})),
    _c("order", "Create a pizza order as JSON with size (small, medium or large), toppings (0 to 4 of cheese, "
       "ham, mushroom, pepper, olive), delivery (boolean) and optionally notes (at most 60 characters).",
       obj({"size": choice("small", "medium", "large"),
            "toppings": items(choice("cheese", "ham", "mushroom", "pepper", "olive"), 0, 4), "delivery": flag()},
           {"notes": text(60)})),
    _c("city_profile", "Describe Berlin as JSON with name (at most 20 characters), country (at most 20 "
       "characters), population (integer 1000 to 40000000) and landmarks (1 to 3 strings of at most 30 "
       "characters).", obj({"name": text(20), "country": text(20), "population": whole(1000, 40_000_000),
                            "landmarks": items(text(30), 1, 3)})),
    _c("meeting", "Schedule a meeting as JSON with topic (at most 40 characters), date (YYYY-MM-DD), time "
       "(HH:MM), attendees (1 to 5 names of at most 20 characters) and online (boolean).",
       obj({"topic": text(40), "date": DATE, "time": CLOCK, "attendees": items(text(20), 1, 5),
            "online": flag()})),
    _c("transaction", "Record a bank transaction as JSON with amount (number 0 to 100000 in steps of 0.25), "
       "currency (three capital letters), type (debit or credit) and counterparty (at most 30 characters).",
       obj({"amount": real(0, 100000, 0.25), "currency": CURRENCY, "type": choice("debit", "credit"),
            "counterparty": text(30)})),
    _c("log_entry", "Write a server log entry as JSON with level (DEBUG, INFO, WARN or ERROR), message (at most 60 "
       "characters), code (integer 100 to 599) and optionally retry (boolean).",
       obj({"level": choice("DEBUG", "INFO", "WARN", "ERROR"), "message": text(60), "code": whole(100, 599)},
           {"retry": flag()})),
    _c("git_commit", "Describe a git commit as JSON with hash (7 lower-case hex characters), author (at most 25 "
       "characters), message (at most 60 characters) and files_changed (integer 1 to 100).",
       obj({"hash": pattern(r"^[0-9a-f]{7}$"), "author": text(25), "message": text(60),
            "files_changed": whole(1, 100)})),
    _c("car", "Describe a car as JSON with make (at most 15 characters), model (at most 15 characters), year "
       "(integer 1950 to 2025), fuel (petrol, diesel, electric or hybrid) and optionally owner, an object with "
       "name (at most 25 characters) and since (integer 1950 to 2025).",
       obj({"make": text(15), "model": text(15), "year": whole(1950, 2025),
            "fuel": choice("petrol", "diesel", "electric", "hybrid")},
           {"owner": obj({"name": text(25), "since": whole(1950, 2025)})})),
    _c("nutrition", "Give the nutrition facts of an apple as JSON with food (at most 20 characters), calories "
       "(integer 0 to 2000) and macros, an object with protein, fat and carbs (numbers from 0 to 200 in steps of "
       "0.5).", obj({"food": text(20), "calories": whole(0, 2000),
                     "macros": obj({"protein": real(0, 200, 0.5), "fat": real(0, 200, 0.5),
                                    "carbs": real(0, 200, 0.5)})})),
    _c("api_error", "Write an API error response as JSON with error, an object with code (integer 400 to 599), "
       "message (at most 60 characters) and optionally details (1 to 3 strings of at most 40 characters).",
       obj({"error": obj({"code": whole(400, 599), "message": text(60)}, {"details": items(text(40), 1, 3)})})),
    _c("forecast", "Give a 3-day weather forecast as JSON with city (at most 20 characters) and days, exactly 3 "
       "objects each with date (YYYY-MM-DD), high (integer -40 to 50) and rain (boolean).",
       obj({"city": text(20), "days": items(obj({"date": DATE, "high": whole(-40, 50), "rain": flag()}), 3, 3)})),
    _c("library_loan", "Record a library loan as JSON with member (an object with id, an integer 1 to 99999, and "
       "name of at most 25 characters), books (1 to 3 objects each with isbn of 13 digits and title of at most "
       "40 characters) and due (YYYY-MM-DD).",
       obj({"member": obj({"id": whole(1, 99999), "name": text(25)}),
            "books": items(obj({"isbn": pattern(r"^[0-9]{13}$"), "title": text(40)}), 1, 3), "due": DATE})),
    _c("game_character", "Create a game character as JSON with name (at most 20 characters), class (warrior, mage "
       "or rogue), level (integer 1 to 99), stats (an object with strength, agility and wisdom, integers 1 to 20) "
       "and inventory (0 to 4 strings of at most 20 characters).",
       obj({"name": text(20), "class": choice("warrior", "mage", "rogue"), "level": whole(1, 99),
            "stats": obj({"strength": whole(1, 20), "agility": whole(1, 20), "wisdom": whole(1, 20)}),
            "inventory": items(text(20), 0, 4)})),
    _c("shipment", "Describe a shipment as JSON with tracking (two capital letters and 9 digits), status "
       "(pending, shipped, delivered or returned), weight_kg (number 0 to 1000 in steps of 0.5), destination (an "
       "object with city of at most 25 characters and country code of two capital letters) and optionally "
       "fragile (boolean).",
       obj({"tracking": pattern(r"^[A-Z]{2}[0-9]{9}$"),
            "status": choice("pending", "shipped", "delivered", "returned"), "weight_kg": real(0, 1000, 0.5),
            "destination": obj({"city": text(25), "country": pattern(r"^[A-Z]{2}$")})}, {"fragile": flag()})),
    _c("payment", "Describe a payment as JSON with amount (integer cents from 1 to 10000000) and method, which is "
       "either a card object (card_last4: 4 digits, brand: visa, mastercard or amex) or a bank object (iban: "
       "two capital letters then 10 to 30 digits).",
       obj({"amount": whole(1, 10_000_000),
            "method": either(obj({"card_last4": pattern(r"^[0-9]{4}$"), "brand": choice("visa", "mastercard",
                                                                                         "amex")}),
                             obj({"iban": pattern(r"^[A-Z]{2}[0-9]{10,30}$")}))})),
    _c("survey", "Summarise a customer survey as JSON with respondent (integer 1 to 10000), answers (2 to 4 "
       "objects each with question of at most 40 characters and answer, either an integer 1 to 5 or a boolean) "
       "and optionally comment (at most 80 characters).",
       obj({"respondent": whole(1, 10000),
            "answers": items(obj({"question": text(40), "answer": either(whole(1, 5), flag())}), 2, 4)},
           {"comment": text(80)})),
)


def schema_cases(count: int | None = None) -> tuple[SchemaCase, ...]:
    """The first `count` cases (None: all of them). `count` is `--schemas`."""
    if count is None:
        return SCHEMA_CASES
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(SCHEMA_CASES):
        raise InvalidArgumentError(f"--schemas: {count!r} must be an integer from 1 to {len(SCHEMA_CASES)}")
    return SCHEMA_CASES[:count]


__all__ = ["SCHEMA_CASES", "SchemaCase", "schema_cases"]
