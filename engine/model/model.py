"""The Qwen3.5/3.6 model (`qwen35` dense, `qwen35moe`, RYS files) as torch modules whose parameter
names are the GGUF tensor names (spec/qwen35-gguf.md §4-§6), and its forward over cache slots.

Weights live in the modules, per-sequence state in `ModelCache`. The full-sequence path
(`cache=None`) is autograd-friendly; wrap inference calls in `torch.inference_mode()`.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T
from torch import nn

from engine.config import ATTN, GDN, ModelConfig
from engine.errors import InputError, ModelFileError
from engine.kernels import PackedWeight, worth_packing
from engine.kernels.fused import SMALL_M
from engine.model.attention import GatedAttention, KVView
from engine.model.cache import GDNSteps, ModelCache
from engine.model.deltanet import GatedDeltaNet
from engine.model.layers import Linear, RMSNorm, SwiGLU, matmul_weight, rope_cos_sin
from engine.model.moe import MoE
from engine.model.mtp import NextN

log = logging.getLogger(__name__)

LOGIT_ROWS = ("all", "last", "none")
STEP_MAX_T = 16   # verifications / MTP drafts of up to this many rows run the compiled step when enabled
# head-less MTP cache commits of up to this many rows run compiled (one graph, dynamic in T) where the MTP block
# holds no packed matrix: the plain steps' MTP sync of a queue of up to 256 entries (spec §5.3) and a server's
# prefill chunk's warm-up. Eager, such a commit cost the demo model ~0.8 ms whatever its rows (17 rows 0.78 ms,
# 100 rows 1.15 on the AMD EPYC), about a plain step; compiled 0.38 and 0.67 (forty-fifth session). Where it holds
# one, see `_commit_rows`
MTP_COMMIT_MAX_T = 256
COMMIT_PIECES_MAX = 4   # a commit into a block with a packed matrix: at most this many compiled calls (`_commit_rows`)


class Block(nn.Module):
    """One block: h += mixer(rms(h, attn_norm)); h += ffn(rms(h, post_attention_norm)) (spec §4)."""

    def __init__(self, cfg: ModelConfig, kind: str, dtype: torch.dtype, device=None, *, ffn: bool = True):
        super().__init__()
        self.kind = kind
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.rms_eps, device)
        self.post_attention_norm = RMSNorm(cfg.n_embd, cfg.rms_eps, device)
        self.mixer = GatedAttention(cfg, dtype, device) if kind == ATTN else GatedDeltaNet(cfg, dtype, device)
        if not ffn:
            self.ffn = None
        elif cfg.is_moe:
            self.ffn = MoE(cfg, dtype, device)
        else:
            self.ffn = SwiGLU(cfg.n_embd, cfg.n_ff, dtype, device)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.ffn is None else h + self.ffn(self.post_attention_norm(h))


@dataclass
class ForwardOutput:
    """hidden_prenorm [B, T, E]: output of the last main block; hidden [B, T, E]: after output_norm
    (what the MTP head takes by default, spec §6.2); logits [B, T, V] ('all'), [B, 1, V] ('last')
    or None ('none'); gdn_steps when asked for (see `GDNSteps`)."""

    hidden_prenorm: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor | None
    gdn_steps: GDNSteps | None = None


@dataclass
class MTPOutput:
    """hidden [B, T, E]: the MTP block's output after shared_head_norm (the input of the next draft
    step), None for a cache commit (`mtp_forward(..., cache, logits='none')`); logits [B, T, V] /
    [B, 1, V] / None."""

    hidden: torch.Tensor | None
    logits: torch.Tensor | None


def gguf_name(param_name: str) -> str:
    """Module parameter name -> GGUF tensor name ('blk.3.mixer.attn_q.weight' -> 'blk.3.attn_q.weight')."""
    return re.sub(r"\.(mixer|ffn)\.", ".", param_name)


class Qwen35Model(nn.Module):
    """token_embd, blk[0 .. L-1] (main blocks then nextn blocks), output_norm, output (None if tied).

    Build with `load_model(path)` or `Qwen35Model(cfg)` (uninitialised weights, e.g. for training;
    `gguf_tensors()` gives the tensors to write back)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device=None,
                 names: set[str] | None = None):
        super().__init__()
        self.cfg = cfg
        E = cfg.n_embd
        self.token_embd = Linear(E, cfg.n_vocab, dtype, device)   # rows are embeddings; also the tied head
        blocks = [Block(cfg, kind, dtype, device) for kind in cfg.layer_kinds]
        for n in cfg.nextn_blocks:
            has_ffn = names is None or any(f"blk.{n}.{t}.weight" in names
                                           for t in ("ffn_down", "ffn_down_exps"))
            blk = Block(cfg, ATTN, dtype, device, ffn=has_ffn)
            blk.nextn = NextN(cfg, names, f"blk.{n}.nextn", dtype, device)
            if names is not None and f"blk.{n}.attn_q.weight" not in names:
                # ik-tolerated form: borrow the last main attention block's attn_q (spec §3.7)
                blk.mixer.attn_q = blocks[cfg.attn_layers[-1]].mixer.attn_q
            blocks.append(blk)
        self.blk = nn.ModuleList(blocks)
        self.output_norm = RMSNorm(E, cfg.rms_eps, device)
        self.output = None if cfg.tied_output else Linear(E, cfg.n_vocab, dtype, device)
        self._steps = None                                       # CompiledSteps when compile_steps() enabled
        self._commit_max: dict[int, int] = {}                    # nextn block -> `_commit_rows`' limit
        self._steps_status = ("eager", "not enabled (Qwen35Model.compile_steps)")
        self.draft_vocab: int | None = None    # MTP drafts choose among the first N token ids (None: all)
        self.draft_weights = "exact"           # the weights a draft chain multiplies by (see set_draft_weights)
        self.wrong_drafts = False              # drafts returned as (argmax + 1) mod vocab (set_wrong_drafts)
        self._draft: dict[int, DraftTwin] = {}  # nextn block number -> its draft copy ('q8_0', 'int8')
        self._slot_idx: dict[tuple, torch.Tensor] = {}   # (slots, device, inference mode) -> index tensor
        self.recipe: dict | None = None        # load_model's arguments (None: built otherwise)

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.token_embd.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.token_embd.weight.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_embd.weight[tokens].float()

    def head(self, h: torch.Tensor, n_rows: int | None = None) -> torch.Tensor:
        """Post-norm hidden [..., E] -> logits [..., V] float32 (of the first n_rows token ids only when
        given: a draft vocabulary, see `set_draft_vocab`)."""
        w = self.token_embd.weight if self.output is None else self.output.weight
        return matmul_weight(h, _first_rows(w, n_rows))

    def set_draft_vocab(self, n: int | None, what: str = "draft vocabulary") -> None:
        """Let MTP drafts choose among the first n token ids only (None or the vocabulary size: all).

        A draft's output head reads n rows instead of the whole vocabulary; BPE vocabularies list tokens
        in merge order, roughly most frequent first (the real Qwen3.5 vocabulary: ids < 65,536 are 98 % of
        the tokens of English prose and Python code, docs/benchmarks.md). Drafts are only proposals:
        verification keeps the output exact at any n (greedy drafts are one-hot, so speculative sampling
        stays exact too); a token past n is never drafted, so acceptance can only drop where the target
        is one. `mtp_forward` (the --mtp-out logits, imatrix) always computes the whole vocabulary.
        what: the setting's name in the error for a size outside 1..vocabulary (e.g. a CLI flag)."""
        V = self.cfg.n_vocab
        if n is not None and not 1 <= n <= V:
            raise InputError(f"{what}: {n} not in 1..{V} (this model's vocabulary)")
        self.draft_vocab = None if n is None or n == V else int(n)

    def set_draft_weights(self, kind: str, what: str = "draft weights") -> None:
        """The weights MTP draft chains multiply by: 'exact' (the file's), 'q8_0', 'int8' or 'int8_dots' (CPU,
        float32 models).

        With 'q8_0' a chain reads Q8_0 copies (ggml's format, ~1.06 bytes a weight) of the nextn block's
        matrices and of the output head wherever the file holds them in a float type (F32, F16, BF16); with
        'int8' int8 copies with one scale per row (`PackedWeight.int8_rows_of`, ~1 byte a weight), whose
        products skip the block scales' multiply; with 'int8_dots' the same rows multiplied by the CPU's 8-bit
        dot products, each activation row rounded to int8 too (`engine.kernels.int8_dots`: AVX-512 VNNI, built
        on first use; an InputError where it cannot run), and the products of one input joined into one call
        (gate and up; attn_q, attn_k and attn_v for a chain's scratch rows, `_draft_twin`). A quantized file's
        packed matrices get the copies too (a row's copy dequantizes it first), except Q8_0 ones for 'q8_0',
        read as they are. A draft reads its weights once per drafted token, so on float
        files the chain reads a quarter (F32) or half (16-bit) of the bytes. Drafts are only proposals: verification keeps the output exact, and the MTP
        cache rows a chain keeps (its first step's) are computed with the exact eh_proj, attn_k and attn_v,
        so the MTP cache stays what exact drafting leaves (spec §1.5); only the draft tokens, hence
        acceptance, can differ. `mtp_forward` (cache commits, --mtp-out, imatrix) always uses the exact
        weights. Memory: the copies (demo model 1.4 MB; a BF16 0.8B file's tied 248,320-row head ~270 MB, as much
        for a quantized one's).
        what: the setting's name in errors (e.g. a CLI flag)."""
        if kind not in DRAFT_WEIGHTS:
            raise InputError(f"{what}: expected one of {', '.join(DRAFT_WEIGHTS)}, got {kind!r}")
        if kind != "exact" and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise InputError(f"{what}: {kind} draft weights run on CPU with float32 weights only "
                             f"(this model: {self.device.type}, {str(self.dtype).removeprefix('torch.')})")
        if kind == "int8_dots":
            from engine.kernels import int8_dots
            ok, why = int8_dots.status()
            if not ok:
                raise InputError(f"{what}: int8_dots: the CPU's 8-bit dot products are {why}")
        twins: dict[int, DraftTwin] = {}
        if kind != "exact" and self.cfg.has_mtp:
            for n in self.cfg.nextn_blocks:
                nx = self.blk[n].nextn
                head = nx.shared_head_head.weight if nx.shared_head_head is not None else \
                    (self.token_embd.weight if self.output is None else self.output.weight)
                twins[n] = DraftTwin(_draft_twin(kind, self.blk[n]), _draft_weight(kind, "head", head))
        self.draft_weights, self._draft = kind, twins
        if self._steps is not None:
            from engine.model.steps import _weights_static
            _weights_static(self)

    def set_wrong_drafts(self, on: bool) -> None:
        """Benchmarks only: every draft a chain returns is (its argmax + 1) mod the vocabulary, a token the
        target model almost never emits there, so a round measures the pure overhead of speculation. The
        chain itself runs unchanged (step j + 1 still reads step j's own argmax) and the offset is applied
        inside the same call, so a round still drafts and verifies in one compiled graph: the cost
        measured is the one a real all-rejected round pays, not that of a slower unfused path."""
        self.wrong_drafts = bool(on)

    def draft_modules(self) -> list[nn.Module]:
        """The draft copies' modules (not submodules of the model: its parameters and GGUF names stay the
        file's); compiled steps mark their packed weights static as they do the model's."""
        return [m for tw in self._draft.values() for m in tw.block.modules()]

    def draft_heads(self) -> list:
        """The draft copies' output heads (`DraftTwin.head`: a Q8_0 `PackedWeight` or the file's tensor),
        held outside any module; compiled steps mark them static too."""
        return [tw.head for tw in self._draft.values()]

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> Qwen35Model:
        """Random initialisation in the transformers style, in the file's conventions (spec §8):
        projections and embeddings N(0, std); RMSNorm weights 1 (the +1 is stored); ssm_norm 1;
        ssm_a = -U(0.01, 16); ssm_dt.bias 1; conv weights U(+-1/sqrt(Kc))."""
        g = torch.Generator(device="cpu").manual_seed(seed)

        def fill(p: torch.Tensor, sample) -> None:
            p.copy_(sample(torch.empty(p.shape, dtype=torch.float32)).to(p.dtype))

        for name, p in self.gguf_tensors().items():
            short = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]
            if short == "ssm_a":
                fill(p, lambda t: -t.uniform_(0.01, 16.0, generator=g))
            elif short == "ssm_dt":
                p.fill_(1.0)
            elif short == "ssm_conv1d":
                bound = p.shape[-1] ** -0.5
                fill(p, lambda t, b=bound: t.uniform_(-b, b, generator=g))
            elif p.dim() == 1 or short.endswith("norm"):
                p.fill_(1.0)
            else:
                fill(p, lambda t: t.normal_(0.0, std, generator=g))
        return self

    def gguf_tensors(self) -> dict[str, torch.Tensor]:
        """GGUF tensor name -> tensor (PyTorch shape), for writing the model back to a file."""
        return {gguf_name(n): p for n, p in self.named_parameters()}

    @staticmethod
    def _rows_check(logits: str) -> None:
        if logits not in LOGIT_ROWS:
            raise ValueError(f"logits must be one of {LOGIT_ROWS}, got {logits!r}")

    @staticmethod
    def _rows(h: torch.Tensor, logits: str) -> torch.Tensor | None:
        return None if logits == "none" else (h if logits == "all" else h[:, -1:])

    def _slots(self, cache: ModelCache, slots: list[int] | None, B: int, T: int,
               lengths: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor, int, tuple[int, int] | None]:
        slots = list(range(B)) if slots is None else list(slots)
        if len(slots) != B or len(set(slots)) != B:
            raise ValueError(f"need {B} distinct slots, got {slots}")
        starts = [lengths[s] for s in slots]
        if max(starts) + T > cache.n_ctx:
            raise InputError(f"context: {max(starts) + T} tokens exceed the cache size n_ctx={cache.n_ctx}")
        dev = self.device
        # never written, so one tensor per slot list (a decode step or round made one each); an inference tensor
        # is kept for inference mode only (outside it autograd may not save one)
        key = (tuple(slots), dev, torch.is_inference_mode_enabled())
        slot_idx = self._slot_idx.get(key)
        if slot_idx is None:
            slot_idx = self._slot_idx[key] = torch.tensor(slots, dtype=torch.long, device=dev)
        if B == 1:   # one op instead of three: every decode step and round of one sequence comes here
            positions = torch.arange(starts[0], starts[0] + T, dtype=torch.long, device=dev)[None]
        else:
            positions = torch.tensor(starts, dtype=torch.long, device=dev)[:, None] + torch.arange(T, device=dev)
        single = (slots[0], starts[0]) if B == 1 else None
        return slots, slot_idx, positions, max(starts) + T, single

    # -- main model ------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, cache: ModelCache | None = None, slots: list[int] | None = None,
                *, logits: str = "all", chunk: int = 64, gdn_steps: bool = False) -> ForwardOutput:
        """Run the main blocks over tokens [B, T] (long).

        Without a cache: each row is a fresh sequence at positions 0..T-1 (training / reference path).
        With a cache: row i appends its T tokens to slot `slots[i]` (default: row i -> slot i) at that
        slot's current length; every row of one call has the same T; the slots' KV and GDN state
        are updated in place and `cache.lengths` advanced by T.
        logits: 'all' rows, only the 'last' row, or 'none' (the output head is skipped).
        chunk: delta-rule chunk length for T > RECURRENT_MAX_T (shorter calls use the per-token form).
        gdn_steps: also return the GDN state after every token (for `cache.rollback`).
        Decode steps (T = 1) and verifications (gdn_steps, T <= STEP_MAX_T) run the compiled step when
        `compile_steps` enabled it."""
        B, T = tokens.shape
        self._rows_check(logits)
        if cache is None:
            slots = list(range(B))
            positions = torch.arange(T, device=self.device).expand(B, T)
            res = self._main(tokens, None, None, positions, T, None, logits, chunk, gdn_steps)
        else:
            slots, slot_idx, positions, n_keys, single = self._slots(cache, slots, B, T, cache.lengths)
            args = (tokens, cache, slot_idx, positions, n_keys, single, logits, chunk, gdn_steps)
            res = None
            if self._steps is not None and (T == 1 or (gdn_steps and T <= STEP_MAX_T)):
                res = self._steps.main(*args)     # decode steps and verifications (not prompt pieces)
            if res is None:
                res = self._main(*args)
            for s in slots:
                cache.lengths[s] += T
        h, h_final, lg, steps_conv, steps_ssm = res
        steps = GDNSteps(slots, T, steps_conv, steps_ssm) if gdn_steps else None
        return ForwardOutput(h, h_final, lg, steps)

    def _main(self, tokens, cache, slot_idx, positions, n_keys, single, logits, chunk, gdn_steps):
        """The tensor work of `forward` (no Python bookkeeping: the compiled step traces this)."""
        h = self.embed(tokens)
        sl = None
        if cache is not None:
            sl = slice(single[0], single[0] + 1) if single is not None else slot_idx
        cos, sin = rope_cos_sin(positions, self.cfg.rope_dim, self.cfg.rope_theta)
        steps_conv, steps_ssm = {}, {}
        for i in range(self.cfg.n_layer):
            blk = self.blk[i]
            a = blk.attn_norm(h)
            if blk.kind == ATTN:
                kv = None if cache is None else KVView(cache.k[i], cache.v[i], slot_idx, positions, n_keys, single)
                h = h + blk.mixer(a, cos, sin, kv)
            else:
                conv0 = None if cache is None else cache.conv[i][sl]
                ssm0 = None if cache is None else cache.ssm[i][sl]
                out, conv, ssm, steps = blk.mixer(a, conv0, ssm0, chunk=chunk, all_states=gdn_steps)
                h = h + out
                if gdn_steps:
                    steps_conv[i], steps_ssm[i] = steps
                if cache is not None:
                    cache.conv[i][sl] = conv
                    cache.ssm[i][sl] = ssm
            h = blk.feed_forward(h)
        h_final = self.output_norm(h)
        rows = self._rows(h_final, logits)
        return h, h_final, None if rows is None else self.head(rows), steps_conv, steps_ssm

    def prefill(self, tokens: torch.Tensor, cache: ModelCache, slots: list[int] | None = None, *,
                chunk_tokens: int = 512, logits: str = "last", chunk: int = 64) -> ForwardOutput:
        """`forward` over a long prompt in pieces of `chunk_tokens` tokens (memory bounded by the piece,
        not the prompt). Returns the hidden rows of all tokens and the requested logits."""
        T = tokens.shape[1]
        outs = []
        for c0 in range(0, T, chunk_tokens):
            piece = tokens[:, c0:c0 + chunk_tokens]
            last_piece = c0 + chunk_tokens >= T
            want = logits if logits == "all" or last_piece else "none"
            outs.append(self.forward(piece, cache, slots, logits=want, chunk=chunk))
        lg = None
        if logits == "all":
            lg = torch.cat([o.logits for o in outs], dim=1)
        elif logits == "last":
            lg = outs[-1].logits
        return ForwardOutput(torch.cat([o.hidden_prenorm for o in outs], dim=1),
                             torch.cat([o.hidden for o in outs], dim=1), lg)

    # -- MTP head --------------------------------------------------------------------------------
    def mtp_forward(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: ModelCache | None = None,
                    slots: list[int] | None = None, *, logits: str = "all", block: int | None = None
                    ) -> MTPOutput:
        """The nextn head over rows (token i, hidden i) (spec §6.1).

        tokens [B, T]; hidden [B, T, E]: row i is the main model's hidden state that predicted
        token i (use `shift_hidden(out.hidden, prev)` for a prompt; for a draft chain pass the
        previous step's `MTPOutput.hidden`). Row i runs at position cache.mtp_lengths[slot] + i
        (0 + i without a cache) and writes the MTP KV row there; `cache.mtp_lengths` advances by T.
        logits='none' with a cache only updates the MTP cache (prompt warm-up, commits): only the rows'
        keys and values are computed (no attention, FFN or head) and `MTPOutput.hidden` is None.
        Without a cache (imatrix, training) the whole block runs."""
        if not self.cfg.has_mtp:
            raise InputError("mtp: this model file has no nextn (MTP) block")
        n = self.cfg.nextn_blocks[0] if block is None else block
        self._rows_check(logits)
        B, T = tokens.shape
        if cache is None:
            positions = torch.arange(T, device=self.device).expand(B, T)
            hm, lg = self._mtp(tokens, hidden, None, None, positions, T, None, logits, n)
            return MTPOutput(hm, lg)
        if not cache.has_mtp:
            raise ValueError("this cache was built without MTP KV")
        rows = T
        if self._steps is None:
            compiled = False
        elif logits != "none":                    # drafts
            compiled = T <= STEP_MAX_T
        else:                                     # cache commits (syncs, prompt pieces, accepted drafts)
            rows = self._commit_rows(n, cache, slots, B, T)
            if 0 < rows < T or (rows and B > 1 and T > 1 and self._commit_max[n] == SMALL_M):
                # in calls of one sequence and `rows` rows each (`_commit_rows`)
                for i, s in enumerate(range(B) if slots is None else slots):
                    for a in range(0, T, rows):
                        self.mtp_forward(tokens[i:i + 1, a:a + rows], hidden[i:i + 1, a:a + rows], cache, [s],
                                         logits="none", block=n)
                return MTPOutput(None, None)
            compiled = rows > 0
            if compiled and T > 1 and self._commit_max[n] == SMALL_M:
                # padding rows after the commit's: written past its end, not kept (as `step1_pad`'s). Built anew even
                # where none is added: the graph's shape is fixed, so its guards check the strides too (a slice of
                # a longer row, as `bench` passes, was traced again in the decoding thread)
                tokens = torch.cat([tokens, tokens[:, -1:].expand(B, rows - T)], 1)
                hidden = torch.cat([hidden, hidden[:, -1:].expand(B, rows - T, hidden.shape[-1])], 1)
        slots, slot_idx, positions, n_keys, single = self._slots(cache, slots, B, max(rows, T), cache.mtp_lengths)
        args = (tokens, hidden, cache, slot_idx, positions, n_keys, single, logits, n)
        res = self._steps.mtp(*args) if compiled else None
        if res is None:
            res = self._mtp(*args)
        for s in slots:
            cache.mtp_lengths[s] += T
        return MTPOutput(*res)

    def _commit_rows(self, n: int, cache: ModelCache, slots: list[int] | None, B: int, T: int) -> int:
        """The rows per sequence of each compiled call that a head-less MTP commit of T rows into block n runs
        as: T; more (padded); fewer (the commit runs in pieces of that many); 0 for one eager call.

        Without a packed matrix in the block: T, up to MTP_COMMIT_MAX_T (one graph, dynamic in T). With one, a
        product of up to SMALL_M rows loops over them in the graph, which fixes the row count, and a longer one
        runs outside it, a graph break at each product: on the Q4_K_M fixture each new commit length of 2..7
        rows was traced again in the decoding thread (9.6-10.6 s each), and a compiled commit of 12 rows took
        2.9-3.1 ms. So there a commit runs in calls of one sequence and SMALL_M rows, the last of each sequence
        padded: one graph (0.39-0.56 ms a call against 1.3-2.2 eager for 2-8 rows; in pieces 0.9-1.7 ms against
        1.9-3.0 for 9-24 rows, 2.0 against 2.7 for 32, a tie at 40; forty-sixth session), up to COMMIT_PIECES_MAX
        calls. (A server's round of several sequences commits their accepted drafts in one pass.) One row keeps
        its kind (a plain step's entry, one row per sequence); the rest run eager, as does a call whose padding
        would pass the cache's end."""
        if n not in self._commit_max:   # asked after loading, which is where matrices are packed
            # (an int8-dots weight's product is one operation for any rows: no such limit)
            packed = any(isinstance(v, PackedWeight) and "qu" not in v.parts
                         for mod in self.blk[n].modules() for v in vars(mod).values())
            self._commit_max[n] = SMALL_M if packed else MTP_COMMIT_MAX_T
        if self._commit_max[n] == MTP_COMMIT_MAX_T or T == 1:
            return T if T <= MTP_COMMIT_MAX_T else 0
        if B * -(-T // SMALL_M) > COMMIT_PIECES_MAX or (slots is not None and (len(slots) != B or len(set(slots)) != B)):
            return 0                               # (wrong slots: `_slots` says what is wrong)
        if T > SMALL_M or B > 1:
            return SMALL_M
        return SMALL_M if cache.mtp_lengths[0 if slots is None else slots[0]] + SMALL_M <= cache.n_ctx else 0

    def _mtp(self, tokens, hidden, cache, slot_idx, positions, n_keys, single, logits, n, local=None, vocab=None,
             draft=False, queued=False):
        """The tensor work of `mtp_forward` -> (post-norm hidden, logits or None); (None, None) for a
        cache commit (a cache, logits 'none'), which computes only the rows' keys and values. local: a
        draft chain's scratch rows (see `KVView`): this step's KV row joins them instead of the cache.
        vocab: logits of the first `vocab` token ids only (a draft chain's `draft_vocab`).
        draft: a draft chain's step, which multiplies by the draft weights (`set_draft_weights`) except
        where a row enters the cache: its input (eh_proj) and its keys and values stay exact there.
        queued: rows [B, T > 1] of which only the last runs the block; the rows before it only enter the cache.
        Every row's key and value is written in one store: inside a compiled graph, a second store into the
        same cache buffer made it a copy of the whole buffer (n_ctx rows, keys and values) every round."""
        blk = self.blk[n]
        nx = blk.nextn
        twin = self._draft.get(n) if draft else None
        kv = None
        if cache is not None:
            kv = KVView(cache.mtp_k[n], cache.mtp_v[n], slot_idx, positions, n_keys, single, local)
        kept = kv is not None and local is None                # this call writes its rows into the cache
        emb = self.embed(tokens) if nx.embed_tokens is None else nx.embed_tokens.weight[tokens].float()
        u = (nx if twin is None or kept else twin.block.nextn).combine(emb, hidden)
        cos, sin = rope_cos_sin(positions, self.cfg.rope_dim, self.cfg.rope_theta)
        if kept and (logits == "none" or queued):
            # the rows' keys and values depend on the block's input only; for a cache commit (prompt warm-up,
            # plain-step sync, accepted drafts) they are all it keeps. A chain's step 1 stores its rows at their
            # positions (not as one slice): padding rows go after the pending row's position (`draft_chain`)
            w = KVView(kv.k, kv.v, slot_idx, positions, n_keys) if queued else kv
            blk.mixer.write_kv(blk.attn_norm(u), cos, sin, w)
            if logits == "none":
                return None, None
        if queued:
            # the pending row, last, at the last position step 1 keeps (n_keys = the cache rows it attends to)
            last = None if single is None else (single[0], n_keys - 1)
            kv = KVView(kv.k, kv.v, slot_idx, positions[:, -1:], n_keys, last, stored=True)
            u, cos, sin = u[:, -1:], cos[:, -1:], sin[:, -1:]
        if twin is not None:
            blk = twin.block          # the same norms, attn_k and attn_v; other matrices its copies
        u = u + blk.mixer(blk.attn_norm(u), cos, sin, kv)
        u = blk.feed_forward(u)
        norm = nx.shared_head_norm if nx.shared_head_norm is not None else self.output_norm
        hm = norm(u)
        rows = self._rows(hm, logits)
        if rows is None:
            return hm, None
        if twin is not None:
            lg = matmul_weight(rows, _first_rows(twin.head, vocab))
        elif nx.shared_head_head is not None:
            lg = matmul_weight(rows, _first_rows(nx.shared_head_head.weight, vocab))
        else:
            lg = self.head(rows, vocab)
        return hm, lg

    @property
    def untimed_calls(self) -> int:
        """How many calls so far took a time that is not their kind's steady state: compiled in the calling
        thread on first use (`--steps compiled`: seconds) or run eager while their kind compiles in the
        background (`CompiledSteps`). Decode loops compare it around a step or round and do not let the MTP
        policies learn from one that includes such a call (a compile inside the first round made it ~5 s, and
        `auto` turned MTP off for the request). 0 without compiled steps."""
        s = self._steps
        return 0 if s is None else getattr(s, "n_eager_calls", 0) + getattr(s, "n_foreground_compiles", 0)

    def step1_rows(self, k: int) -> int:
        """The length one sequence's draft step 1 (queued entries and the pending token) is padded to for a
        chain of k drafts, 0 for none (eager steps): see `step1_pad`."""
        return 0 if self._steps is None else self._steps.step1_rows(k)

    def step1_queue_max(self, k: int) -> int:
        """How many queued MTP entries one sequence's draft step 1 of a chain of k drafts takes along: k, or as
        many as its padded length holds (`step1_rows`); a longer backlog is written before the round."""
        return max(k, self.step1_rows(k) - 1)

    def step1_pad(self, cache: ModelCache, slot: int, t: int, k: int) -> int:
        """How many padding rows one sequence's chain of k drafts in `slot` should add to its step 1 of t rows:
        with compiled steps each step-1 length is a graph of its own (a compile of ~50 s on 2 vCPUs), padded
        to one length (`step1_rows`) a request meets one per k. Callers put the padding rows (any token and
        hidden row: the pending one's) just before the pending row, as they build the rows (padding them here
        took ~20 us a round of extra tensor ops), and pass `pad` to `draft_chain` / `draft_and_verify`. 0 where nothing is gained (eager steps, t longer than that length) or where the
        rows' positions would pass the cache's end."""
        n = self.step1_rows(k)
        if not t <= n or cache.mtp_lengths[slot] + n - 1 >= cache.n_ctx:
            return 0
        return n - t

    def draft_chain(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: ModelCache, slots: list[int],
                    k: int, *, block: int | None = None, pad: int | Sequence[int] = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """k greedy MTP drafts per row in one call (spec §2): step 1 runs over the rows (token i, hidden
        i) of tokens [B, T] / hidden [B, T, E] (queued cache entries, then the pending token and its
        carry) with the head on the last row only; steps 2..k each take the previous draft and MTP
        hidden. Argmax stays on the device. Returns drafts [B, k] (long) and the last MTP hidden [B, 1, E].
        Step 1's T rows are written to the MTP cache (`cache.mtp_lengths` advances by T); steps 2..k
        attend to them and to each other's rows without writing the cache (scratch rows, see `KVView`).
        With compiled steps the whole chain is one graph (one call instead of k).
        pad: one sequence's rows T - 1 - pad .. T - 2 are padding (`step1_pad`): written after the pending
        row's position, not kept (`cache.mtp_lengths` advances by T - pad). Several sequences: one count each
        (`step1_pads`), or one for all."""
        n = self._chain_block(k, block)
        B, T = tokens.shape
        slots, slot_idx, positions, n_keys, single = self._step1_slots(cache, slots, B, T, k, pad)
        args = (tokens, hidden, cache, slot_idx, positions, n_keys, single, k, n)
        res = None
        if self._steps is not None and T + k - 1 <= STEP_MAX_T:
            res = self._steps.chain(*args)
        if res is None:
            res = self._chain(*args)
        for s, p in zip(slots, _pads(pad, B), strict=True):
            cache.mtp_lengths[s] += T - p
        return res

    def step1_pads(self, cache: ModelCache, slots: list[int], ts: list[int], k: int) -> list[int] | None:
        """Padding rows per sequence for a chain (or round) of k drafts of several sequences whose step 1 would
        hold ts[i] rows (queued entries and the pending token, each t <= k + 1): each is padded to k + 1 rows,
        so the sequences share one step 1 and the chain is one call, where unpadded each step-1 length took a
        call of its own (and each a compiled kind). Padding rows go just before each pending row, as one
        sequence's do (`step1_pad`). None where that cannot be: a backlog longer than k + 1 or, for a
        sequence, rows past the cache's end."""
        n = k + 1
        if any(not 0 < t <= n for t in ts) or any(cache.mtp_lengths[s] + n - 1 >= cache.n_ctx for s in slots):
            return None
        return [n - t for t in ts]

    def _step1_slots(self, cache: ModelCache, slots: list[int], B: int, T: int, k: int,
                     pad: int | Sequence[int]) -> tuple:
        """`_slots` for a chain of k drafts whose step 1 has T rows, `pad` of them padding (one sequence; for
        several, one count per sequence). A sequence's padding rows take the positions after its pending
        row's: the chain's steps 2..k attend only to the cache rows up to the pending one (one sequence: the
        attended rows end there; several: masked per sequence by position, see `GatedAttention._attend_local`), and
        the rows after it are written again before they are read."""
        pads = _pads(pad, B)
        if not any(pads):
            return self._slots(cache, slots, B, T + k - 1, cache.mtp_lengths)
        if len(pads) != B or not all(0 <= p < T for p in pads):
            raise ValueError(f"padding rows: {pads} of a step 1 of {T} rows for {B} sequences")
        slots, slot_idx, _, _, single = self._slots(cache, slots, B, 1, cache.mtp_lengths)
        rows, ends = [], []
        for s, p in zip(slots, pads, strict=True):
            start = cache.mtp_lengths[s]
            P = start + T - p - 1                # the pending row's position
            if P + k > cache.n_ctx:
                raise InputError(f"context: {P + k} tokens exceed the cache size n_ctx={cache.n_ctx}")
            if P + p >= cache.n_ctx:
                raise InputError(f"context: padding rows past the cache size n_ctx={cache.n_ctx}")
            rows.append([*range(start, P), *range(P + 1, P + 1 + p), *range(P, P + k)])
            ends.append(P + k)
        return slots, slot_idx, torch.tensor(rows, dtype=torch.long, device=self.device), max(ends), single

    def _chain_block(self, k: int, block: int | None) -> int:
        """The nextn block a chain of k drafts runs (checks the model has one and k >= 1)."""
        if not self.cfg.has_mtp:
            raise InputError("mtp: this model file has no nextn (MTP) block")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return self.cfg.nextn_blocks[0] if block is None else block

    def _chain(self, tokens, hidden, cache, slot_idx, positions, n_keys, single, k, n):
        """The tensor work of `draft_chain`; positions [B, T + k - 1] cover every step's rows."""
        T = tokens.shape[1]
        V = self.draft_vocab                       # drafts among the first V token ids (None: all)
        n_cached = n_keys - k + 1                  # cache rows once step 1 has written its T rows
        # step 1's rows before the last (queued entries) only enter the cache (`queued`), then the whole block
        # runs for the last row, which attends to them
        hm, lg = self._mtp(tokens, hidden, cache, slot_idx, positions[:, :T], n_cached, single, "last", n, vocab=V,
                           draft=True, queued=cache is not None and T > 1)
        tok = lg[:, -1:].argmax(dim=-1)
        hid = hm[:, -1:]
        drafts = [tok]
        local = None if cache is None else ([], [])
        for j in range(1, k):
            hm, lg = self._mtp(tok, hid, cache, slot_idx, positions[:, T + j - 1:T + j], n_cached, single,
                               "last", n, local, V, draft=True)
            tok = lg[:, -1:].argmax(dim=-1)
            hid = hm
            drafts.append(tok)
        out = torch.cat(drafts, dim=1)
        if self.wrong_drafts:
            out = (out + 1) % self.cfg.n_vocab
        return out, hid

    def draft_and_verify(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: ModelCache, slots: list[int],
                         k: int, *, chunk: int = 64, block: int | None = None, pad: int | Sequence[int] = 0
                         ) -> tuple[torch.Tensor, ForwardOutput, torch.Tensor]:
        """A speculative round's tensor work in one call: `draft_chain` (k drafts from tokens [B, T] /
        hidden [B, T, E], the last row being the pending token s0 and its carry), then the verification
        `forward` of [s0, d1..dk] (all logits, per-step GDN states) and its argmax. Returns drafts [B, k],
        the verification's ForwardOutput and the target tokens [B, k+1] (long, on the device).
        `cache.mtp_lengths` advances by T - pad (padding rows: see `draft_chain`) and `cache.lengths` by k + 1,
        as the two calls would. With compiled steps this is one graph: a round pays one call's host overhead
        instead of two plus the eager glue between them (demo model: see docs/benchmarks.md)."""
        n = self._chain_block(k, block)
        B, T = tokens.shape
        slots, slot_idx, c_pos, c_keys, c_single = self._step1_slots(cache, slots, B, T, k, pad)
        _, _, m_pos, m_keys, m_single = self._slots(cache, slots, B, k + 1, cache.lengths)
        args = (tokens, hidden, cache, slot_idx, c_pos, c_keys, c_single, m_pos, m_keys, m_single, k, n, chunk)
        res = None
        if self._steps is not None and max(T + k - 1, k + 1) <= STEP_MAX_T:
            res = self._steps.round(*args)
        if res is None:
            res = self._round(*args)
        for s, p in zip(slots, _pads(pad, B), strict=True):
            cache.mtp_lengths[s] += T - p
            cache.lengths[s] += k + 1
        drafts, h, h_final, lg, conv, ssm, target = res
        return drafts, ForwardOutput(h, h_final, lg, GDNSteps(slots, k + 1, conv, ssm)), target

    def _round(self, tokens, hidden, cache, slot_idx, c_pos, c_keys, c_single, m_pos, m_keys, m_single, k, n,
               chunk):
        """The tensor work of `draft_and_verify`."""
        drafts, _ = self._chain(tokens, hidden, cache, slot_idx, c_pos, c_keys, c_single, k, n)
        rows = torch.cat([tokens[:, -1:], drafts], dim=1)
        h, h_final, lg, conv, ssm = self._main(rows, cache, slot_idx, m_pos, m_keys, m_single, "all", chunk, True)
        return drafts, h, h_final, lg, conv, ssm, lg.argmax(dim=-1)

    # -- compiled steps --------------------------------------------------------------------------
    def compile_steps(self, mode: str = "auto", *, background: bool = True) -> tuple[str, str]:
        """Run cached calls of up to STEP_MAX_T tokens (decode steps, MTP drafts, verification) as
        `torch.compile`d graphs (engine/model/steps.py). mode: 'compiled', 'eager' or 'auto' (compiled
        when a C++ compiler / Triton is there; MTPCHAT_STEPS=eager|compiled overrides 'auto').
        background: compile each kind of call in a worker thread, eager until it is ready (default),
        else compile on first use. Returns (path, why)."""
        from engine.model.steps import CompiledSteps, choose

        path, why = choose(mode, self.device)
        self._steps = CompiledSteps(self, why, background=background) if path == "compiled" else None
        self._steps_status = (path, why)
        return self.steps_status

    @property
    def steps_status(self) -> tuple[str, str]:
        """(path, why): 'compiled' or 'eager', and the reason (see `compile_steps`)."""
        if self._steps is not None:
            return self._steps.status()
        return self._steps_status


def _pads(pad: int | Sequence[int], B: int) -> list[int]:
    """A chain's padding rows per sequence: one count for all, or one each (`Qwen35Model.step1_pads`)."""
    return [pad] * B if isinstance(pad, int) else list(pad)


# -- loading -------------------------------------------------------------------------------------
_REFUSED = ("ssm_in.weight", "ssm_ba.weight")


def load_model(f, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
               packed: bool = False, min_packed: int | None = None) -> Qwen35Model:
    """Build the model from a `GGUFFile` (or a path): every module parameter is the dense dequantized
    GGUF tensor of the same name (2-D/3-D weights in `dtype`, norms, ssm_a/dt/conv in float32).
    packed=True (CPU, float32): Q8_0/Q4_K/BF16/F16 matrices of ≥ 512K weights stay compact as `PackedWeight`s that
    `matmul_weight` multiplies with the fused kernels of engine/kernels (the reference is packed=False).
    min_packed: the smallest matrix kept packed (default: PACKED_MIN_WEIGHTS; with compiled steps every
    matrix pays, see `engine.model.steps.min_packed`)."""
    from engine.gguf import open_gguf
    from engine.gguf.validate import check_model_gguf
    from engine.weights import load_weights

    if not hasattr(f, "tensors"):
        f = open_gguf(f)
    # Every tensor's presence, shape and type is checked before any weight is read (reliability A4).
    cfg = check_model_gguf(f, require_tokenizer=False).config
    names = set(f.tensors)
    for n in names:
        if n.endswith(_REFUSED):
            raise ModelFileError(f.path, f"{n}: fused Qwen3-Next tensor in a {cfg.arch} file is not supported")
    device = torch.device(device)
    with torch.device("meta"):
        model = Qwen35Model(cfg, dtype, None, names)
    weights = load_weights(f, "cpu")
    used = set()
    params = dict(model.named_parameters())
    for pname, p in params.items():
        name = gguf_name(pname)
        if name not in weights:
            raise ModelFileError(f.path, f"{name}: required tensor missing")
        w = weights[name]
        numel = 1
        for d in w.shape:
            numel *= d
        if numel != p.numel() or (len(w.shape) > 1 and tuple(w.shape[-1:]) != tuple(p.shape[-1:])):
            raise ModelFileError(f.path, f"{name}: shape {tuple(w.shape)} does not match the expected {tuple(p.shape)}")
        if packed and device.type == "cpu" and worth_packing(w.ggml_type, tuple(w.shape), min_packed) \
                and tuple(w.shape) == tuple(p.shape):
            _set_packed(model, pname, PackedWeight.from_gguf(name, w.ggml_type, tuple(w.shape), w.raw))
            used.add(name)
            continue
        t = w.dense(p.dtype, device).reshape(p.shape)
        _set_param(model, pname, t)
        used.add(name)
    for n in sorted(names - used):
        log.info("tensor %s not used by the engine", n)
    log.info("loaded %s: %s (%s, %s)", f.path, cfg.layer_pattern(), dtype, device)
    model.eval()
    # how to load the same model again: a compile child (engine.model.compile_child) does, to compile kinds
    # of call whose graphs then load from inductor's cache here
    model.recipe = {"path": str(f.path), "device": str(device), "dtype": dtype, "packed": packed,
                    "min_packed": min_packed}
    return model


DRAFT_WEIGHTS = ("exact", "q8_0", "int8", "int8_dots")
# nextn matrices a draft copy keeps exact: the keys and values its cached rows hold (the row's input,
# eh_proj, is chosen per call in `_mtp`), and lookup tables
_DRAFT_EXACT = ("attn_k", "attn_v", "embed_tokens", "shared_head_head")


@dataclass
class DraftTwin:
    """What a draft chain multiplies by for one nextn block: `block`, a copy of the block whose modules
    share the block's tensors except the matrices it holds in the draft form, and `head`, the output head's weight."""

    block: Block
    head: object


def _draft_weight(kind: str, name: str, w):
    """The draft form `kind` of a weight: a Q8_0 copy ('q8_0', rows of 32-multiples only) or an int8 copy
    with a scale per row ('int8', 'int8_dots'); another shape as it is. An already quantized packed weight gets
    the copy too (rows dequantized, then rounded), except a Q8_0 one for 'q8_0': a quantized file's own blocks
    cost a draft far more to unpack than its bytes save (compiled steps, AMD EPYC with AVX-512 VNNI, int8_dots: a
    draft row of the tiny Q4_K_M fixture 0.53-0.66 -> 0.058-0.066 ms, of the Q8_0 one 0.097-0.100 -> 0.061-0.063
    ms; docs/benchmarks.md, forty-first session; AVX2, 'q8_0': see the forty-sixth session)."""
    packed = isinstance(w, PackedWeight)
    quantized = packed and w.ggml_type not in (T.BF16, T.F16)
    if quantized and (w.ggml_type == T.I8 or (kind == "q8_0" and w.ggml_type == T.Q8_0)):
        return w
    # 16-bit rows as they are, quantized ones packed: the copies widen or dequantize a slice at a time
    src = w.parts["w"] if packed and not quantized else w
    if src.ndim != 2:
        return w
    if kind == "int8":
        return PackedWeight.int8_rows_of(name, src)
    if kind == "int8_dots":
        return PackedWeight.int8_rows_of(name, src).as_int8_dots()
    if src.shape[1] % 32:
        return w
    # our own copy, so where compiled kernels run AVX2 code in the layout they read fastest
    # (PackedWeight.as_words; not measured with AVX-512, whose 16 lanes would span two blocks' scales)
    from engine.kernels import codegen
    q8 = PackedWeight.q8_0_of(name, src)
    return q8.as_words() if codegen.avx2() else q8


def _draft_twin(kind: str, mod: nn.Module, name: str = "") -> nn.Module:
    """A copy of `mod` and its submodules (new module objects, the same tensors) whose `Linear` weights
    are in the draft form `kind` (`_draft_weight`), except those named in _DRAFT_EXACT. With 'int8_dots'
    the products that read the same input are joined too (`_joined_rows`): gate and up, and for a chain's
    scratch rows attn_q, attn_k and attn_v."""
    twin = copy.copy(mod)                          # a new object; its dicts still the original's
    twin._parameters = dict(mod._parameters)
    twin._buffers = dict(mod._buffers)
    twin._modules = {k: None if c is None else _draft_twin(kind, c, k) for k, c in mod._modules.items()}
    if isinstance(mod, Linear) and name not in _DRAFT_EXACT:
        w = _draft_weight(kind, name, mod.weight)
        if w is not mod.weight:
            twin._parameters.pop("weight", None)
            twin.__dict__["weight"] = w
    if kind == "int8_dots" and isinstance(mod, SwiGLU):
        twin.__dict__["draft_gate_up"] = _joined_rows("ffn_gate_up", mod.ffn_gate, mod.ffn_up)
    if kind == "int8_dots" and isinstance(mod, GatedAttention):
        twin.__dict__["draft_qkv"] = _joined_rows("attn_qkv", mod.attn_q, mod.attn_k, mod.attn_v)
    return twin


def _joined_rows(name: str, *mods: Linear) -> PackedWeight | None:
    """One int8_dots weight holding the rows of several weights of one input size, in order: their products
    in one operator call. Rows are scaled one by one, so each part's rows are its own copy's (`_draft_weight`).
    None where a weight has no such copy (not 2-D) or the sizes differ."""
    parts = [_draft_weight("int8_dots", name, m.weight) for m in mods]
    if any(not isinstance(w, PackedWeight) or "qu" not in w.parts or w.shape[1] != parts[0].shape[1]
           for w in parts):
        return None
    return PackedWeight(name, T.I8, (sum(w.shape[0] for w in parts), parts[0].shape[1]),
                        {key: torch.cat([w.parts[key] for w in parts]) for key in ("qu", "d")})


def _first_rows(w, n: int | None):
    """The first n rows of a 2-D weight (dense: a view; packed: `PackedWeight.first_rows`), or w itself."""
    if n is None:
        return w
    return w.first_rows(n) if isinstance(w, PackedWeight) else w[:n]


def _set_packed(model: nn.Module, pname: str, value: PackedWeight) -> None:
    mod_path, _, attr = pname.rpartition(".")
    mod = model.get_submodule(mod_path) if mod_path else model
    del mod._parameters[attr]
    setattr(mod, attr, value)


def _set_param(model: nn.Module, pname: str, value: torch.Tensor) -> None:
    mod_path, _, attr = pname.rpartition(".")
    mod = model.get_submodule(mod_path) if mod_path else model
    setattr(mod, attr, nn.Parameter(value, requires_grad=False))


__all__ = ["DRAFT_WEIGHTS", "Block", "ForwardOutput", "MTPOutput", "Qwen35Model", "gguf_name", "load_model", "GDN", "ATTN"]
