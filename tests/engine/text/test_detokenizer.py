"""Streaming detokenizer and stop strings: rows C1-C4 (spec/reliability-matrix.md §5)."""

from __future__ import annotations

import itertools
import random

from engine.text import StopMatcher, StreamingDetokenizer, TextStream

CHARS = ["a", "Z", " ", "\n", "é", "ß", "Ж", "中", "文", "ก", "्", "€", "😀", "👍", "\U0001F3FD", "𠀀", "\u200d"]
INVALID = [b"\xff", b"\xc0", b"\x80", b"\xbf", b"\xe4\xb8", b"\xf0\x9f\x98", b"\xed\xa0\x80", b"\xf8"]


def _random_byte_tokens(rng: random.Random, invalid: bool) -> list[bytes]:
    data = bytearray()
    for _ in range(rng.randint(1, 40)):
        if invalid and rng.random() < 0.1:
            data += rng.choice(INVALID)
        else:
            data += rng.choice(CHARS).encode()
    tokens, i = [], 0
    while i < len(data):  # cut anywhere, also inside 2-, 3- and 4-byte characters
        n = rng.randint(1, 4)
        tokens.append(bytes(data[i:i + n]))
        i += n
    return tokens


def _is_proper_utf8_prefix(held: bytes) -> bool:
    if not held:
        return True
    if len(held) > 3:
        return False
    for n in range(1, 4):
        for tail in itertools.product((0x80, 0x90, 0xA0, 0xBF), repeat=n):
            try:
                (held + bytes(tail)).decode("utf-8")
                return True
            except UnicodeDecodeError:
                continue
    return False


def test_c1_c2_seeded_split_characters():
    seed = 1234
    rng = random.Random(seed)
    steps = max_held = 0
    for n in range(10_000):
        tokens = _random_byte_tokens(rng, invalid=n % 2 == 1)
        detok = StreamingDetokenizer()
        chunks = []
        for t in tokens:
            chunks.append(detok.push_bytes(t))
            steps += 1
            held = detok.held
            max_held = max(max_held, len(held))
            assert _is_proper_utf8_prefix(held), (seed, n, tokens, held)
        chunks.append(detok.flush())
        full = b"".join(tokens).decode("utf-8", "replace")
        assert "".join(chunks) == full, (seed, n, tokens)
        assert sum(c.count("\ufffd") for c in chunks) == full.count("\ufffd"), (seed, n, tokens)
    assert max_held <= 3
    print(f"METRIC C1 seqs=10000 mismatches=0 spurious_fffd=0 seed={seed}")
    print(f"METRIC C2 steps={steps} max_held={max_held} violations=0")


def test_c1_real_tokenizer_multilingual(qwen_tok, tokenizer_goldens):
    n = 0
    for c in tokenizer_goldens:
        if c["category"] in ("added_token_text",):
            continue
        detok = StreamingDetokenizer(qwen_tok.token_bytes)
        chunks = [detok.push(i) for i in c["ids"]] + [detok.flush()]
        assert "".join(chunks) == qwen_tok.decode(c["ids"]), c["text"]
        assert all("\ufffd" not in ch for ch in chunks) or "\ufffd" in qwen_tok.decode(c["ids"])
        n += 1
    assert n >= 200


def test_c2_lone_continuation_bytes_drain_at_once():
    detok = StreamingDetokenizer()
    for _ in range(10_000):
        assert detok.push_bytes(b"\x80") == "\ufffd"
        assert detok.held_bytes == 0
    assert detok.flush() == ""


def _final_text(full: str, stops: list[str]) -> tuple[str, bool]:
    best = None
    for s in stops:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return (full[:best[1]], True) if best else (full, False)


def test_c3_every_end_reason_flushes_the_tail():
    # tails of 0-3 pending bytes x end reasons (eos, max_tokens, cancel, stop string), streaming vs one-shot
    table = {0: b"", 1: "é".encode()[:1], 2: "中".encode()[:2], 3: "😀".encode()[:3]}
    token_bytes = {0: b"hello ", 1: "wörld".encode(), 2: b" STOP", 3: b"!"}
    cases = 0
    for tail_len, tail in table.items():
        for reason in ("eos", "max_tokens", "cancel", "stop"):
            tb = {**token_bytes, 9: tail}
            ids = [0, 1, 3, 9] if reason != "stop" else [0, 9, 1, 2, 3]
            raw = b"".join(tb[i] for i in ids)
            stream = TextStream(tb.__getitem__, stops=["STOP"])
            out = []
            for i in ids:
                d = stream.push([i])
                out.append(d.text)
                if d.stopped:
                    break
            out.append(stream.finish().text)
            expected, _ = _final_text(raw.decode("utf-8", "replace"), ["STOP"])
            assert "".join(out) == expected, (tail_len, reason)
            if reason != "stop" and tail_len:
                assert expected.endswith("\ufffd")
            cases += 1
    print(f"METRIC C3 cases={cases} equal={cases}")


STOP_SETS = [
    ["STOP"], ["ab", "abc"], ["abc", "ab"], ["b", "abcd"], ["\n\n"], ["<|im_end|>"], ["</think>"],
    ["😀x"], ["中文"], ["é!"], ["x", "y", "z"], ["the end"], ["aaa"], ["aa", "a"], ["👍🏽"], ["END", "ENDING"],
    ["<tool_call>", "</tool_call>"], [" "], ["ca", "cat", "category"], ["Observation:"], ["\n"], ["zzzz"],
    ["😀😀"], ["ab\n", "b\nc"],
]
ALPHABET = ["a", "b", "c", "x", "y", "z", " ", "\n", "😀", "中", "文", "é", "!", "👍", "\U0001F3FD", "t", "h",
            "e", "n", "d", "<", ">", "|", "/", "S", "T", "O", "P", "END"]


def test_c4_stop_strings_never_leak():
    seed = 99
    rng = random.Random(seed)
    leaks = truncations = chunkings = 0
    for set_no, stops in enumerate(STOP_SETS):
        for _script in range(4):
            parts = [rng.choice(ALPHABET) for _ in range(rng.randint(5, 40))]
            if rng.random() < 0.7:
                parts.insert(rng.randint(0, len(parts)), rng.choice(stops))
            data = "".join(parts).encode()
            tokens, i = [], 0
            while i < len(data):
                n = rng.randint(1, 5)
                tokens.append(data[i:i + n])
                i += n
            expected, _ = _final_text(data.decode("utf-8", "replace"), stops)
            for k in range(20):
                chunkings += 1
                stream = TextStream(tokens.__getitem__, stops=stops)
                emitted, pos = "", 0
                while pos < len(tokens):
                    step = 1 if k == 0 else rng.randint(1, 4)  # token by token, then MTP-like groups
                    d = stream.push(range(pos, min(pos + step, len(tokens))))
                    pos += step
                    emitted += d.text
                    if not expected.startswith(emitted):
                        leaks += 1
                    if d.stopped:
                        break
                emitted += stream.finish().text
                if emitted != expected:
                    truncations += 1
                assert emitted == expected, (seed, set_no, stops, tokens, k)
    assert leaks == 0
    print(f"METRIC C4 sets={len(STOP_SETS)} chunkings={chunkings} leaks={leaks} truncations={truncations}")


def test_stop_matcher_holds_only_a_possible_prefix():
    m = StopMatcher(["abc"])
    assert m.push("xxa") == ("xx", False) and m.held == "a"
    assert m.push("b") == ("", False) and m.held == "ab"
    assert m.push("d") == ("abd", False) and m.held == ""
    assert m.push("zab") == ("z", False)
    assert m.push("c tail") == ("", True)
    assert m.matched == "abc" and m.push("more") == ("", True)
    m2 = StopMatcher(["abc"])
    m2.push("ab")
    assert m2.flush() == "ab"
