"""Pipeline.chat: the tokenizer's chat template, one BOS, one output per conversation."""

import pytest

from servelab import Pipeline, SamplingParams
from servelab.models import load_model, load_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the cache?"}]


@pytest.fixture(scope="module")
def pipe(tiny):
    tokenizer = load_tokenizer(tiny["llama"])
    tokenizer.chat_template = TEMPLATE
    model, _ = load_model(tiny["llama"])
    return Pipeline(model, tokenizer)


def test_chat_applies_the_template_with_one_bos(pipe):
    tok = pipe.tokenizer
    text = tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<s><|system|>") and text.endswith("<|assistant|>")
    (out,) = pipe.chat(CONV, GREEDY)
    assert out.prompt == text
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids.count(tok.bos_token_id) == 1 and out.prompt_token_ids[0] == tok.bos_token_id
    assert tok.encode(text).count(tok.bos_token_id) == 2  # what a plain generate(text) would have sent
    assert out.token_ids == pipe.generate([out.prompt_token_ids], GREEDY)[0].token_ids


def test_chat_takes_a_list_of_conversations(pipe):
    second = [{"role": "user", "content": "Boats carry wood"}]
    outs = pipe.chat([CONV, second], [GREEDY, SamplingParams(temperature=0.0, max_tokens=3)])
    assert [o.index for o in outs] == [0, 1] and [len(o.token_ids) for o in outs] == [8, 3]
    assert outs[1].prompt.endswith("<|user|>Boats carry wood\n<|assistant|>")
    no_prompt = pipe.chat(second, GREEDY, add_generation_prompt=False)[0]
    assert not no_prompt.prompt.endswith("<|assistant|>")


def test_chat_errors_say_what_is_missing(tiny, pipe):
    plain = Pipeline.from_pretrained(tiny["llama"])  # the tiny tokenizer has no chat template
    with pytest.raises(ValueError, match="no chat template; pass chat_template="):
        plain.chat(CONV)
    assert plain.chat(CONV, GREEDY, chat_template=TEMPLATE)[0].prompt.startswith("<s><|system|>")
    model, _ = load_model(tiny["llama"])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        Pipeline(model).chat(CONV)
    for bad in ("hello", [], [{"content": "no role"}], [[{"role": "user", "content": "x"}], "y"]):
        with pytest.raises(TypeError, match="conversation"):
            pipe.chat(bad)
