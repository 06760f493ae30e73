"""Token alignment between different tokenizers (receiver-based, one sharer token per receiver token) and the
layer mappings, then a full cross-tokenizer fusion run."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cortexstream.c2c import C2CProjectorFuser, TokenAligner, k_nearest, last_aligned
from cortexstream.c2c.pipeline import fused_prompt_cache
from cortexstream.errors import InvalidArgumentError
from tiny_models import byte_level_alphabet, tiny_model

SHARER_SPECIALS = ["<s>", "</s>", "<unk>", "<|im_start|>"]
SHARER_MERGES = ["t h", "th e", "i n", "Ġ in"]  # differs from the receiver's: "Ġthe" -> "Ġ" + "the"


def sharer_tokenizer() -> PreTrainedTokenizerFast:
    vocab_list = SHARER_SPECIALS + byte_level_alphabet() + [m.replace(" ", "") for m in SHARER_MERGES]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    bpe = models.BPE(vocab, [tuple(m.split(" ")) for m in SHARER_MERGES], unk_token="<unk>")
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SHARER_SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tokenizers_pair(tiny):
    return tiny[1], sharer_tokenizer()


def test_one_sharer_token_per_receiver_token(tokenizers_pair):
    receiver, sharer = tokenizers_pair
    text = "in the thin inn"
    ids = receiver.encode(text, add_special_tokens=False)
    first = TokenAligner(receiver, sharer, "first")
    aligned = first.align(ids)
    assert len(aligned) == len(ids)
    for rid, sid in zip(ids, aligned):  # every sharer token is a prefix piece of its receiver token's text
        piece = receiver.decode([rid])
        assert piece.startswith(sharer.decode([sid]))
    the = receiver.encode(" the", add_special_tokens=False)
    assert len(the) == 1  # one receiver token ("Ġthe") ...
    assert sharer.encode(" the", add_special_tokens=False) == [sharer.convert_tokens_to_ids("Ġ"),
                                                               sharer.convert_tokens_to_ids("the")]
    assert sharer.decode(first.align(the)) == " "  # ... "first" takes the leading piece
    assert sharer.decode(TokenAligner(receiver, sharer, "longest").align(the)) == "the"  # "longest" the longest
    assert first.num_one_to_many >= 1


def test_special_tokens_map_by_role_then_text(tokenizers_pair):
    receiver, sharer = tokenizers_pair
    aligner = TokenAligner(receiver, sharer)
    eos = receiver.eos_token_id
    assert aligner.map_token(eos) == sharer.eos_token_id  # <|im_end|>/<|endoftext|> -> </s> by role
    im_start = receiver.convert_tokens_to_ids("<|im_start|>")
    assert aligner.map_token(im_start) == sharer.convert_tokens_to_ids("<|im_start|>")  # same literal text
    with pytest.raises(InvalidArgumentError):
        TokenAligner(receiver, sharer, "middle")


def test_layer_mappings():
    assert last_aligned(2, 2) == {0: [0], 1: [1]}
    assert last_aligned(3, 6, k=2) == {0: [3, 2], 1: [4, 3], 2: [5, 4]}
    assert last_aligned(2, 1, k=2) == {0: [0], 1: [0]}
    assert k_nearest(3, 5) == {0: [0], 1: [2], 2: [4]}
    assert k_nearest(1, 3) == {0: [0]}
    with pytest.raises(InvalidArgumentError):
        last_aligned(0, 3)


def test_cross_tokenizer_fusion_end_to_end(tokenizers_pair):
    import mlx.core as mx

    receiver_tok, sharer_tok = tokenizers_pair
    receiver = tiny_model(21)
    sharer = tiny_model(22, vocab_size=len(sharer_tok), num_hidden_layers=3, num_key_value_heads=1)
    ids = receiver_tok.encode("in the thin inn, the end", add_special_tokens=False)
    sharer_ids = TokenAligner(receiver_tok, sharer_tok).align(ids)
    fuser = C2CProjectorFuser.from_models(sharer, receiver, hidden_dim=32, intermediate_dim=32)
    for p in fuser.projectors:
        p.key_gate_logit, p.value_gate_logit = mx.array(1.0), mx.array(1.0)
    cache, last = fused_prompt_cache(receiver, ids, sharer, sharer_ids, fuser)
    assert cache[0].size() == len(ids) - 1
    assert receiver(last[None], cache=cache).shape[1] == 1
