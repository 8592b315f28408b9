"""Greedy output through the server equals `mtpchat generate`, MTP on and off, 1 and 4 busy slots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from engine.generate import generate
from engine.gguf import open_gguf
from engine.model.model import load_model
from tests.conftest import REPO, fixture_path

PROMPT_LENGTHS = (1, 7, 33, 64)
N_TOKENS = 32


@pytest.fixture(scope="module")
def references(model_path):
    ref = np.load(fixture_path("ref/tiny-qwen35.npz"))
    prompts = {n: [int(t) for t in ref[f"prompt_{n}"]] for n in PROMPT_LENGTHS}
    # `mtpchat generate` once as a command, the other prompts through the same function in-process
    n0 = PROMPT_LENGTHS[0]
    r = subprocess.run([sys.executable, "-m", "app", "generate", "--model", str(model_path), "--tokens",
                        ",".join(map(str, prompts[n0])), "--max-tokens", str(N_TOKENS), "--ignore-eos", "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    out = {n0: (prompts[n0], json.loads(r.stdout)["tokens"])}
    torch.set_num_threads(1)
    model = load_model(open_gguf(model_path))
    for n, p in prompts.items():
        toks = generate(model, p, max_tokens=N_TOKENS).tokens
        if n in out:
            assert out[n][1] == toks
        out[n] = (p, toks)
        assert toks[:24] == [int(t) for t in ref[f"greedy_{n}"]]  # generate itself matches transformers
    return out


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--parallel", "4", "--ctx", "4096")


@pytest.mark.parametrize("mtp", ["off", "on", "adaptive", "auto"])
def test_server_greedy_equals_generate(server, references, mtp):
    def ask(c, prompt, slot):
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0,
                                            "ignore_eos": True, "return_tokens": True, "mtp": mtp,
                                            "id_slot": slot})
        assert r.status_code == 200, r.text
        return r.json()

    with server.client() as c:
        for n, (prompt, want) in references.items():     # one busy slot
            got = ask(c, prompt, 0)
            assert got["tokens"] == want, (mtp, n)
            if mtp == "on":
                assert got["timings"]["draft_n"] > 0
    results = {}

    def worker(i, n):
        with server.client() as c:
            results[n] = ask(c, references[n][0], i)["tokens"]

    threads = [threading.Thread(target=worker, args=(i, n)) for i, n in enumerate(PROMPT_LENGTHS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for n in PROMPT_LENGTHS:                                  # four busy slots
        assert results[n] == references[n][1], (mtp, n)


def test_penalties_give_the_same_greedy_tokens_with_and_without_mtp(server, references):
    def ask(c, prompt, mtp):
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0,
                                            "ignore_eos": True, "return_tokens": True, "mtp": mtp,
                                            "repeat_penalty": 1.3, "presence_penalty": 0.5,
                                            "frequency_penalty": 0.2})
        assert r.status_code == 200, r.text
        return r.json()

    results = {}
    with server.client() as c:
        for n, (prompt, plain) in references.items():
            off = ask(c, prompt, "off")
            on = ask(c, prompt, "on")
            assert on["tokens"] == off["tokens"], n
            assert on["timings"]["draft_n"] > 0
            if n > 1:
                assert off["tokens"] != plain   # the penalties do change the text
            results[n] = off["tokens"]
    busy = {}

    def worker(n):
        with server.client() as c:
            busy[n] = ask(c, references[n][0], "on")["tokens"]

    threads = [threading.Thread(target=worker, args=(n,)) for n in PROMPT_LENGTHS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert busy == results                  # four busy slots, MTP on == one slot, MTP off
