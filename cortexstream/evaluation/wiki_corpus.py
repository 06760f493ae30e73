"""Real English text (Wikipedia articles from gensim's test data) that benchmarks score and trainers learn from.

The text is the English Wikipedia dump excerpt that ships inside the gensim wheel's test data
(`enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`, 2016 articles such as "Anarchism").
The wheel is fetched from PyPI with `pip download --no-deps` (never installed) into a cache folder, the bz2 XML is
read straight from the zip, and wiki markup is stripped simply (templates, tables, refs, links, emphasis,
headings). If that fails, the Python docs' topic texts in `pydoc_data` are the fallback, and the JSON says so.
"""

from __future__ import annotations

import bz2
import glob
import os
import re
import subprocess
import sys
import zipfile
import xml.etree.ElementTree as ET

GENSIM_VERSION = "4.4.0"
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "cortexstream", "quality")


def _strip_templates(text: str) -> str:
    """Remove {{...}} and {|...|} blocks, nested, in one pass."""
    out, depth, i = [], 0, 0
    while i < len(text):
        pair = text[i : i + 2]
        if pair in ("{{", "{|"):
            depth += 1
            i += 2
        elif depth and pair in ("}}", "|}"):
            depth -= 1
            i += 2
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def strip_wiki(text: str) -> str:
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>/]*/>", "", text)
    text = re.sub(r"<ref[^>]*>.*?</ref>", "", text, flags=re.S)
    text = _strip_templates(text)
    text = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", text)
    text = re.sub(r"\[\[[^\]|]*\|([^\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[\[([^\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", text)
    text = re.sub(r"\[https?://\S+\]", "", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", text, flags=re.M)
    lines = [ln.strip() for ln in text.splitlines()]
    keep = [ln for ln in lines if ln and not ln.startswith(("*", "#", "|", "!", ":", ";", "{", "}", "__"))]
    paragraphs = [ln for ln in keep if len(ln.split()) >= 8]  # drop headings, list stubs and table debris
    return "\n".join(paragraphs).replace("&nbsp;", " ")


def _wheel() -> str:
    os.makedirs(CACHE_DIR, exist_ok=True)
    found = glob.glob(os.path.join(CACHE_DIR, f"gensim-{GENSIM_VERSION}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        f"gensim=={GENSIM_VERSION}", "-d", CACHE_DIR, "-q"], check=True, timeout=600)
        found = glob.glob(os.path.join(CACHE_DIR, f"gensim-{GENSIM_VERSION}-*.whl"))
    if not found:
        raise FileNotFoundError("gensim wheel not downloaded")
    return found[0]


def wiki_text() -> tuple[str, str]:
    """(text, source description): Wikipedia articles joined by blank lines, or the pydoc fallback."""
    cached = os.path.join(CACHE_DIR, "enwiki-gensim.txt")
    source = f"English Wikipedia excerpt from gensim {GENSIM_VERSION} test data ({os.path.basename(WIKI_MEMBER)})"
    if os.path.exists(cached):
        return open(cached, encoding="utf-8").read(), source
    try:
        with zipfile.ZipFile(_wheel()) as wheel:
            xml = bz2.decompress(wheel.read(WIKI_MEMBER))
        root = ET.fromstring(xml)
        articles = []
        for page in root.iter():
            if not page.tag.endswith("}page"):
                continue
            ns = next((c.text for c in page if c.tag.endswith("}ns")), "0")
            body = next((t.text for t in page.iter() if t.tag.endswith("}text")), "") or ""
            if ns != "0" or body.lstrip().upper().startswith("#REDIRECT"):
                continue
            clean = strip_wiki(body)
            if len(clean) > 2000:
                articles.append(clean)
        text = "\n\n".join(articles)
        with open(cached, "w", encoding="utf-8") as fh:
            fh.write(text)
        return text, source
    except Exception as exc:  # noqa: BLE001 - any failure falls back to local text, recorded in the results
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics)), f"pydoc_data topics (gensim text unavailable: {exc})"
