"""Child process of the A6 test: change the model file during and after load, never die of a signal.

Usage: python -m tests.engine.gguf.a6_child WORKDIR SEED. Prints one `METRIC A6 ...` line; exits 0
only when every during-load case ended in ModelFileError and every after-load case decoded the
reference tokens.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from pathlib import Path

import torch

from engine.errors import ModelFileError
from engine.gguf import load_model_file
from tests.engine.gguf.tiny_gguf import tiny_plan, write

CHANGES = ("truncate0", "truncate_half", "zeros", "replace", "delete")


def change(path: Path, how: str, other: Path) -> None:
    size = path.stat().st_size
    if how == "truncate0":
        os.truncate(path, 0)
    elif how == "truncate_half":
        os.truncate(path, size // 2)
    elif how == "zeros":
        with open(path, "r+b") as fh:
            fh.write(bytes(size))
        os.utime(path, ns=(1, 1))
    elif how == "replace":
        tmp = path.with_suffix(".new")
        shutil.copyfile(other, tmp)
        os.replace(tmp, path)
    else:
        path.unlink()


def greedy(model, n: int = 8) -> list[int]:
    tokens = [1, 2]
    with torch.inference_mode():
        for _ in range(n):
            logits = model.forward(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(torch.nan_to_num(logits, nan=-1e30).argmax()))
    return tokens[2:]


def main(workdir: Path, seed: int) -> int:
    from engine.model.model import load_model

    rng = random.Random(seed)
    original = write(tiny_plan(seed=1), workdir / "original.gguf")
    other = write(tiny_plan(seed=2), workdir / "other.gguf")
    reference = greedy(load_model(load_model_file(original).gguf))
    path = workdir / "model.gguf"
    clean = identical = 0
    problems = []
    for case in range(10):  # during load: after a random number of tensors
        shutil.copyfile(original, path)
        how = rng.choice(CHANGES)
        m = load_model_file(path)
        stop = rng.randrange(len(m.gguf.tensors))
        try:
            for i, _ in enumerate(m.gguf.read_tensors()):
                if i == stop:
                    change(path, how, other)
            problems.append(f"during #{case} {how} at tensor {stop}: no error")
        except ModelFileError as exc:
            clean += "changed" in exc.what or "cannot reopen" in exc.what
    for case in range(10):  # after load
        shutil.copyfile(original, path)
        model = load_model(load_model_file(path).gguf)
        how = rng.choice(CHANGES)
        change(path, how, other)
        got = greedy(model)
        if got == reference:
            identical += 1
        else:
            problems.append(f"after #{case} {how}: {got} != {reference}")
    print(f"METRIC A6 during=10 clean_errors={clean} after=10 identical={identical} signals=0")
    for p in problems:
        print(p)
    return 0 if clean == 10 and identical == 10 and not problems else 1


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), int(sys.argv[2])))
