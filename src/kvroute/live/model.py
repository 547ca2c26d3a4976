"""``kvroute model tiny DIR``: the CPU profile's tiny random-weight Qwen2 model, built here.

No weights can be downloaded on the build machines, and the study measures prefill,
caching and timing rather than text, so the ``cpu`` profile serves a model built
locally (docs/live.md, "vLLM on this machine"):

* **Tokenizer**: a BPE tokenizer trained with the ``tokenizers`` library on the 4,096
  vocabulary words of :mod:`kvroute.live.text`, so every word of the load generator's
  text (`` baba``, `` dodo``, ...) is one token and a trace's token counts hold on the
  real engine too (plus a token where a message starts). Its pipeline is Qwen2's
  (byte-level), which transformers imposes on a ``qwen2`` model, but its alphabet is
  printable ASCII, space, newline and tab only (a full byte-level alphabet made every
  streamed token decode to an empty string); other characters are dropped.
* **Chat template**: Qwen2's ChatML (``<|im_start|>role\\n...<|im_end|>\\n``), with
  ``<|im_start|>``, ``<|im_end|>`` (EOS) and ``<|endoftext|>`` (padding) as special tokens.
* **Model**: Qwen2 architecture, 4 layers, hidden 256, 4 heads (2 KV heads), random
  weights from a fixed seed. The output rows of the special tokens and the padding are
  zero, so their logit is exactly 0 while the largest of ~4,000 random logits is
  positive: greedy decoding (the load generator's temperature 0) never emits them, and
  every streamed token carries text.

Everything is seeded: the same seed gives the same files byte for byte (the
tokenizer's training is deterministic on a fixed corpus). It needs ``torch``,
``transformers`` and ``tokenizers``, which live in the engine environment
(``make engine-cpu`` builds ``.venv-engine-cpu``); ``kvroute model tiny`` run from an
environment without them re-runs itself under ``$KVROUTE_ENGINE_PYTHON`` or
``.venv-engine-cpu/bin/python``. The module form works too::

    .venv-engine-cpu/bin/python -m kvroute.live.model tiny results/models/tiny-qwen2
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import click

from kvroute.live import text

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: the bytes the tokenizer knows: printable ASCII, space, newline, tab (no other byte is in its alphabet)
ASCII_BYTES = [*range(0x20, 0x7F), 0x0A, 0x09]
DEFAULTS = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512, "vocab_size": 6144,
            "seed": 0, "max_positions": 4096}


def _corpus(seed: int) -> list[str]:
    """Training text: every vocabulary word, several times, in a seeded order, plus the template's words."""
    import random

    rng = random.Random(seed)
    words = list(text.VOCAB)
    lines = []
    for _ in range(4):
        rng.shuffle(words)
        lines += [" ".join(words[i:i + 32]) for i in range(0, len(words), 32)]
    lines += ["system user assistant"] * 64
    return lines


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer(vocab_size: int = DEFAULTS["vocab_size"], seed: int = 0):
    """A ``PreTrainedTokenizerFast`` trained here (ASCII alphabet, one token per vocabulary word).

    Its pipeline is Qwen2's (NFC, Qwen2's split regex, ByteLevel without a prefix space,
    ByteLevel decoder), because transformers loads a ``qwen2`` model's tokenizer as
    ``Qwen2Tokenizer``, which keeps the vocabulary and merges but rebuilds that pipeline.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    chars = _byte_chars()
    alphabet = sorted(chars[b] for b in ASCII_BYTES)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet), min_frequency=1,
                                  show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = DEFAULTS["max_positions"]
    return fast


def build_tiny_model(out: str | os.PathLike, *, seed: int = DEFAULTS["seed"], layers: int = DEFAULTS["layers"],
                     hidden: int = DEFAULTS["hidden"], heads: int = DEFAULTS["heads"],
                     kv_heads: int = DEFAULTS["kv_heads"], intermediate: int = DEFAULTS["intermediate"],
                     vocab_size: int = DEFAULTS["vocab_size"]) -> dict:
    """Write the tiny model (config, weights, tokenizer, chat template) to ``out``; returns facts about it."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size, seed)
    n_vocab = len(tok)
    padded = -(-n_vocab // 64) * 64
    special_ids = sorted({tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS})
    cfg = Qwen2Config(
        vocab_size=padded, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=DEFAULTS["max_positions"],
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, torch_dtype="bfloat16", use_cache=True,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        # never sampled (greedy): the special tokens and the padding rows get logit exactly 0
        never = special_ids + list(range(n_vocab, padded))
        model.lm_head.weight[never] = 0.0
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                                               pad_token_id=cfg.pad_token_id, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    facts = {"seed": seed, "parameters": params, "vocab": n_vocab, "vocab_padded": padded,
             "never_sampled_ids": special_ids, "padding_ids": [n_vocab, padded], "layers": layers, "hidden": hidden}
    (out / "kvroute-model.json").write_text(json.dumps(facts, indent=1) + "\n")
    return facts


def _have_deps() -> bool:
    return all(importlib.util.find_spec(m) for m in ("torch", "transformers", "tokenizers"))


def engine_python_for_model() -> str | None:
    """A Python with torch + transformers: $KVROUTE_ENGINE_PYTHON, else .venv-engine-cpu's."""
    for cand in (os.environ.get("KVROUTE_ENGINE_PYTHON"), ".venv-engine-cpu/bin/python",
                 str(Path(__file__).resolve().parents[3] / ".venv-engine-cpu" / "bin" / "python")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK) and os.path.abspath(cand) != os.path.abspath(sys.executable):
            return cand
    return None


def template_overhead(tokenizer, samples: int = 9) -> dict[str, int]:
    """The chat template's tokens per message (:class:`kvroute.hardware.ChatTemplate`),
    counted with ``tokenizer`` (a Hugging Face tokenizer with a chat template) on the load
    generator's own message text (:mod:`kvroute.live.text`): what the engine adds to a
    trace's counts. Each count is split where the message's content ends in the rendered
    text, so a token the tokenizer spends at a message's start counts into its ``open``.
    Replies in history are the load generator's text of the reply's size with a leading
    space (a stand-in for the streamed text: this model streams whole words, each with its
    space, so a reply costs no token at its start). The median over ``samples`` draws of text (a message's first word
    costs one token or two)."""
    import statistics

    def enc(s: str) -> int:
        return len(tokenizer.encode(s, add_special_tokens=False))

    def render(msgs: list[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)

    def split(msgs: list[dict], before: str, n: int) -> tuple[int, int]:
        """(open, close) of the last message, of ``n`` trace tokens: the tokens from ``before``
        to its content's end beyond ``n``, and those after it."""
        r, c = render(msgs, False), msgs[-1]["content"]
        end = r.rindex(c) + len(c)
        return enc(r[:end]) - enc(before) - n, enc(r) - enc(r[:end])

    counts: dict[str, list[int]] = {}
    for k in range(samples):
        sys_msg = {"role": "system", "content": text.system_text(f"template-{k}", 40)}
        user = {"role": "user", "content": text.user_text(f"template-{k}", 0, 30)}
        reply = {"role": "assistant", "content": " " + text.user_text(f"template-{k}", 1, 20)}
        so, sc = split([sys_msg], "", 40)
        uo, uc = split([sys_msg, user], render([sys_msg], False), 30)
        prompt = render([sys_msg, user], True)
        gen = enc(prompt) - enc(render([sys_msg, user], False))
        hist = enc(render([sys_msg, user, reply], False)) - enc(prompt) - 20
        for key, v in (("system_open", so), ("system_close", sc), ("user_open", uo), ("user_close", uc),
                       ("generation_prompt", gen), ("assistant_close", hist)):
            counts.setdefault(key, []).append(v)
    return {key: int(statistics.median(v)) for key, v in counts.items()}


@click.group("model")
def model_command() -> None:
    """Build the models the engines serve."""


@model_command.command("tiny")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=DEFAULTS["seed"], show_default=True, help="Seed of the random weights.")
def tiny(out: Path, seed: int) -> None:
    """Build the tiny random-weight Qwen2 model of the `cpu` profile in OUT (deterministic)."""
    if not _have_deps():
        py = engine_python_for_model()
        if py is None:
            raise click.ClickException("torch/transformers/tokenizers are not installed here; build the engine "
                                       "environment with `make engine-cpu` (or set KVROUTE_ENGINE_PYTHON)")
        cmd = [py, "-m", "kvroute.live.model", "tiny", str(out), "--seed", str(seed)]
        raise SystemExit(subprocess.call(cmd))
    facts = build_tiny_model(out, seed=seed)
    click.echo(f"{out}: Qwen2, {facts['layers']} layers, hidden {facts['hidden']}, {facts['parameters']:,} parameters, "
               f"vocabulary {facts['vocab']} (seed {seed})")


@model_command.command("template")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def template(model_dir: Path) -> None:
    """Print MODEL_DIR's chat-template overhead per message as the `chat_template` of
    hardware/models.yaml (the tokenizer is the input; docs/costmodel.md)."""
    if not _have_deps():
        py = engine_python_for_model()
        if py is None:
            raise click.ClickException("transformers is not installed here; build the engine environment with "
                                       "`make engine-cpu` (or set KVROUTE_ENGINE_PYTHON)")
        raise SystemExit(subprocess.call([py, "-m", "kvroute.live.model", "template", str(model_dir)]))
    from transformers import AutoTokenizer

    counts = template_overhead(AutoTokenizer.from_pretrained(str(model_dir)))
    click.echo("chat_template: {" + ", ".join(f"{k}: {v}" for k, v in counts.items()) + "}")


if __name__ == "__main__":
    model_command()
