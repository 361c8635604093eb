"""CudaModel: the whole forward on one device, with the DS4Model interface (new_state / forward / logits).

Legend: T tokens, S HC streams, d = n_embd, V vocabulary.

`forward(state, tokens)` prefills chunks of `prefill_chunk` tokens layer-major; a single token runs the decode
step, replayed from a CUDA graph captured once per state (static buffers, position and token in device
tensors, so a replay needs no host work besides copying the token in). `decode_greedy` chains graph replays
with the argmax computed on the device (the benchmark's loop: no host sync per token).

Many sessions (issue 8): `new_states(n, ctx)` returns n states viewing one KVPool; `decode_batch(states,
tokens)` runs one step for all of them at their own positions (ds4.model.cuda.batch), replayed from a CUDA
graph captured per batch bucket (1, 2, 4, 8, ... rows; the padded rows write the pool's scratch slot).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

from ds4.config import ModelConfig
from ds4.model.block import Block, load_layer
from ds4.model.cuda import fused
from ds4.model.cuda.batch import decode_layer_batch
from ds4.model.cuda.layer import SideMatrices, hmatvec, lin, prefill_layer, qmatvec, step_memo
from ds4.model.cuda.state import DeviceKVState, KVPool
from ds4.model.cuda.weights import QLinear, RawSource, WeightStore
from ds4.model.hc import HCWeights
from ds4.model.state import KVState

# Tokens per prefill chunk. Each chunk runs all layers and dequantizes every routed expert it uses (~180 ms a
# chunk for the full model on the H200), so fewer, longer chunks pay that less often: an 8k prompt from empty
# (synthetic Flash q2, tools/gpu/prefill_ab.py, session 9) 2.207 s at 4096, 1.878 s at 8192; peak GPU memory
# 97.8 -> 99.8 GiB. Env DS4_PREFILL_CHUNK.
DEFAULT_PREFILL_CHUNK = int(os.environ.get("DS4_PREFILL_CHUNK", "8192"))
# decode_batch of ONE session through the single-state graph (captured once per state, no pool gathers; the
# speed of forward(state, [tok])). 0: through the pool's bucket-1 graph (one capture per pool; timed as "1*"
# by tools/gpu/batch_check.py). Env DS4_BATCH1_SINGLE.
BATCH1_SINGLE = os.environ.get("DS4_BATCH1_SINGLE", "1") != "0"

# Decode graphs per context bucket: a step whose rows all sit below `bound` tokens ranks only the first
# bound // ratio compressed rows in the indexer (layer.indexer_width), so a session allocated for 1M tokens
# but 3k deep sorts 2k scores per ratio-4 layer, not 256k. Buckets: powers of two from CTX_BUCKET_MIN tokens,
# one graph each (captured when a session first reaches it), none once the bucket covers the session's ctx.
# On: +4.1 % decode for a 256k allocation 2k deep on the H200 (tools/gpu/ctx_ab.py, session 7); env
# DS4_CTX_BUCKETS=0: off. Each capture runs one warm-up step for real and puts back what it overwrote
# (DecodeRunner._capture, DeviceKVState.step_restorer): KB per layer, not a copy of the session's KV.
CTX_BUCKETS = os.environ.get("DS4_CTX_BUCKETS", "1") != "0"
CTX_BUCKET_MIN = 8192


def ctx_bound(tokens: int, ctx: int) -> int | None:
    """The bound (tokens) of a decode step whose rows see at most `tokens` tokens each, in sessions of ctx:
    the power-of-two bucket, or None (no bound) with buckets off or once the bucket reaches ctx."""
    if not CTX_BUCKETS:
        return None
    b = max(CTX_BUCKET_MIN, 1 << max(0, tokens - 1).bit_length())
    return None if b >= ctx else b


# Decode reads the small side matrices (compressors, indexer proj / q_b, router) from float16 copies, one
# hmatvec per input, instead of f32 GEMVs per matrix (they are F16 in the file: the copies are exact). On CUDA
# by default (env DS4_SIDE_HALF=0: off); CudaModel(side_half=...) overrides. Prefill keeps the f32 matrices.
SIDE_HALF = os.environ.get("DS4_SIDE_HALF", "1") != "0"
# Decode reads q_a + kv (both fed by xn) and the shared expert's gate + up (both fed by xf) as one packed
# matrix each (one qmatvec instead of two; the QLinears become row views of it). Env DS4_MERGE_PACKED=0: off.
MERGE_PACKED = os.environ.get("DS4_MERGE_PACKED", "1") != "0"


class CudaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        source: RawSource,
        *,
        has: Callable[[str], bool],
        device: str | torch.device = "cuda",
        dtype: torch.dtype | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        graphs: bool = True,
        kernels: bool | None = None,
        compile: bool | None = None,
        side_half: bool | None = None,
    ) -> None:
        self.cfg, self.device = cfg, torch.device(device)
        if dtype is None:  # exact float32 for small models; bf16 tensor-core GEMMs at Flash size
            dtype = torch.bfloat16 if cfg.n_embd >= 2048 else torch.float32
        self.dtype, self.prefill_chunk = dtype, prefill_chunk
        self.graphs = graphs and self.device.type == "cuda"
        if kernels is None:  # packed-weight Triton kernels for decode when they exist and a GPU runs them
            kernels = self.device.type == "cuda" and qmatvec is not None
        self.kernels = kernels
        if compile is None:  # fuse the decode step's element-wise chains (fused.py) on CUDA
            compile = self.device.type == "cuda" and os.environ.get("DS4_COMPILE", "1") != "0"
        fused.SWITCH.enabled = compile
        store = WeightStore(cfg, source, has, self.device, dtype, kernels)

        def get(name: str):
            return store.packed(name) if store.roles.get(name) else store.dense(name)

        self.embd = get("token_embd.weight")  # [V, d]
        self.layers = []
        for il in range(cfg.n_layer):
            blk = Block(cfg, il, load_layer(cfg, il, get, has))
            blk.inv_freq = blk.inv_freq.to(self.device)
            self.layers.append(blk)
        if side_half is None:
            side_half = SIDE_HALF and self.device.type == "cuda"
        side_half = side_half and hmatvec is not None
        for blk in self.layers:  # SideMatrices: half copies / merged packed decode matrices, or None
            blk.side = side_matrices(blk.w, side_half, MERGE_PACKED and kernels)
        self.head_hc = HCWeights(
            fn=get("output_hc_fn.weight"),
            scale=get("output_hc_scale.weight"),
            base=get("output_hc_base.weight"),
        )
        self.output_norm = get("output_norm.weight")
        self.output = get("output.weight")  # [V, d]
        # the single state is slot 0 of a one-slot pool for the decode kernels: one zero, made once (not a
        # fill kernel in every replayed step)
        self._slot0 = torch.zeros(1, dtype=torch.long, device=self.device)
        self._pool = None  # one memory pool shared by every captured decode graph
        self._pool_graphs: weakref.WeakSet = weakref.WeakSet()  # the live graphs captured into it

    def capture(self, body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """A CUDA graph of body() in the shared decode pool. torch releases a pool with its last graph, and a
        capture into a released handle fails an allocator assert (torch 2.11): once no graph of the pool is
        alive (its sessions gone), the next capture starts a fresh pool."""
        if self._pool is None or not len(self._pool_graphs):
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            body()
        self._pool_graphs.add(g)
        return g

    # ---- states ------------------------------------------------------------------------------

    def new_state(self, ctx: int) -> DeviceKVState:
        if ctx <= 0:
            raise ValueError(f"context size must be positive, got {ctx}")
        return DeviceKVState(self.cfg, ctx, self.device)

    def new_states(self, n: int, ctx: int) -> list[DeviceKVState]:
        """n empty states of context ctx, views of ONE preallocated KVPool (for decode_batch)."""
        return list(KVPool(self.cfg, n, ctx, self.device).states)

    def state_from_cpu(self, cpu: KVState) -> DeviceKVState:
        state = self.new_state(cpu.ctx)
        state.load_cpu(cpu)
        return state

    def weight_bytes(self) -> int:
        """Bytes of every weight tensor held on the device."""
        seen, total = set(), 0
        head = SimpleNamespace(e=self.embd, o=self.output, n=self.output_norm, hc=self.head_hc)
        tensors = _tensors_of(head)
        for blk in self.layers:
            tensors += _tensors_of(blk.w)
            if blk.side is not None:  # its merged packed matrices are counted through the QLinear row views
                tensors += [blk.side.xn, blk.side.router, blk.side.q_b]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    # ---- forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, state: DeviceKVState, tokens: Sequence[int]) -> torch.Tensor:
        """Feed tokens at positions state.n_tokens.. (mutating state); float32 logits [V] of the last one."""
        cfg, T, p0 = self.cfg, len(tokens), state.n_tokens
        if T == 0:
            raise ValueError("forward needs at least one token, got none")
        if p0 + T > state.ctx:
            raise ValueError(f"context overflow: {p0} tokens + {T} new > ctx {state.ctx}")
        bad = [t for t in tokens if not 0 <= int(t) < cfg.n_vocab]
        if bad:
            raise ValueError(f"token id out of range [0, {cfg.n_vocab}): got {bad[0]}")
        if T == 1:
            return self._decode(state, int(tokens[0]))
        logits = None
        for a in range(0, T, self.prefill_chunk):
            logits = self._prefill(state, list(tokens[a : a + self.prefill_chunk]))
        return logits

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embd[ids].float()  # [T, d]
        return e[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, S, d] copies

    def _prefill(self, state: DeviceKVState, tokens: list[int]) -> torch.Tensor:
        p0 = state.n_tokens
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        X = self._embed(ids)
        for blk, kv in zip(self.layers, state.layers, strict=True):
            X = prefill_layer(blk, kv, X, ids, p0, self.dtype)
        state.n_tokens = p0 + len(tokens)
        return self.logits(X[-1:])[0]

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """Output head: HC collapse, output_norm, vocabulary projection. X [T, S, d] -> [T, V]."""
        h = fused.head_norm(X, self.head_hc, self.output_norm, self.cfg.rms_eps, self.cfg.hc_eps)
        return lin(h, self.output)

    def decode_step(
        self, state: DeviceKVState, token: torch.Tensor, pos: torch.Tensor, bound: int | None = None
    ) -> torch.Tensor:
        """The graph body: token [1], pos [1] device tensors -> logits [1, V]; mutates state's buffers.
        bound: pos < bound (tokens), or None (ctx_bound)."""
        X = self._embed(token)
        with step_memo():
            X = self._decode_layers(X, [kv.as_pool() for kv in state.layers], token, pos, self._slot0, bound)
        return self.logits(X)

    def _decode_layers(self, X, kvs, token, pos, slot, bound):
        """X through every layer's decode step (kvs: the pool layers); each layer's last HC post may hand
        the next layer its mixing partials (batch.decode_layer_batch)."""
        mix = None
        for i, (blk, kv) in enumerate(zip(self.layers, kvs, strict=True)):
            nxt = self.layers[i + 1].w.hc_attn.fn if i + 1 < len(self.layers) else None
            X, mix = decode_layer_batch(blk, kv, X, token, pos, slot, bound, mix, nxt)
        return X

    def _decode(self, state: DeviceKVState, token: int) -> torch.Tensor:
        runner = self.runner(state)
        runner.token.fill_(token)
        runner.pos.fill_(state.n_tokens)
        runner.step(ctx_bound(state.n_tokens + 1, state.ctx))
        state.n_tokens += 1
        return runner.logits[0].clone()

    def runner(self, state: DeviceKVState) -> DecodeRunner:
        r = getattr(state, "_runner", None)
        if r is None:
            r = state._runner = DecodeRunner(self, state)
        return r

    @torch.inference_mode()
    def decode_batch(self, states: Sequence[DeviceKVState], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step for B sessions of one pool: tokens[b] is fed to states[b] at its own position
        (each mutated). Returns float32 logits [B, V]. One session runs the single-state graph path."""
        cfg, B = self.cfg, len(states)
        if B == 0 or len(tokens) != B:
            raise ValueError(f"decode_batch needs one token per state: got {len(tokens)} tokens, {B} states")
        pool = getattr(states[0], "pool", None)
        if pool is None or any(getattr(s, "pool", None) is not pool for s in states):
            raise ValueError("decode_batch needs states of one pool (from one model.new_states call)")
        if len({s.slot for s in states}) != B:
            raise ValueError("decode_batch got the same state twice (one token per session per step)")
        for s in states:
            if s.n_tokens + 1 > s.ctx:
                raise ValueError(f"context overflow: {s.n_tokens} tokens + 1 new > ctx {s.ctx}")
        toks = [int(t) for t in tokens]
        bad = [t for t in toks if not 0 <= t < cfg.n_vocab]
        if bad:
            raise ValueError(f"token id out of range [0, {cfg.n_vocab}): got {bad[0]}")
        if B == 1 and BATCH1_SINGLE:  # the single-state graph (no gathers): batch 1 stays as fast as before
            return self._decode(states[0], toks[0])[None]
        if pool.runner is None:
            pool.runner = BatchRunner(self, pool)
        logits = pool.runner.step([s.slot for s in states], toks, [s.n_tokens for s in states])
        for s in states:
            s.n_tokens += 1
        return logits

    def decode_step_batch(self, pool: KVPool, inputs: torch.Tensor, bound: int | None = None) -> torch.Tensor:
        """The batched graph body: inputs [3, B] device int64 rows (slot, token, pos) -> logits [B, V].
        bound: every pos < bound (tokens), or None (ctx_bound)."""
        slot, token, pos = inputs[0], inputs[1], inputs[2]
        X = self._embed(token)  # [B, S, d]
        with step_memo():
            X = self._decode_layers(X, pool.layers, token, pos, slot, bound)
        return self.logits(X)

    @torch.inference_mode()
    def decode_greedy(
        self, state: DeviceKVState, first_token: int, n: int, *, exclude: int | None = None
    ) -> torch.Tensor:
        """Feed first_token, then n-1 times the argmax of the previous logits (never `exclude`), on device.

        Returns the n tokens fed (device int64 [n]); state.n_tokens advances by n. No host sync inside.
        """
        if state.n_tokens + n > state.ctx:
            raise ValueError(f"context overflow: {state.n_tokens} tokens + {n} new > ctx {state.ctx}")
        runner = self.runner(state)
        fed = torch.empty(n, dtype=torch.long, device=self.device)
        runner.token.fill_(first_token)
        runner.pos.fill_(state.n_tokens)
        for i in range(n):
            fed[i : i + 1].copy_(runner.token)
            runner.step(ctx_bound(state.n_tokens + i + 1, state.ctx))
            if exclude is not None:
                runner.logits[0, exclude] = float("-inf")
            runner.token.copy_(runner.logits[0].argmax().view(1))
            runner.pos.add_(1)
        state.n_tokens += n
        return fed


def _half_copy(mats: list) -> torch.Tensor | None:
    """The matrices [n_i, K] stacked as one float16 [sum n_i, K] when that is exact (F16 file weights), else
    None (quantized or wider values: those keep their own GEMVs)."""
    if not mats or not all(isinstance(m, torch.Tensor) and m.is_floating_point() for m in mats):
        return None
    from ds4.kernels.matvec import HALF_K_ALIGN

    full = torch.cat([m.float() for m in mats])
    if full.shape[1] % HALF_K_ALIGN:
        return None
    half = full.half()
    return half.contiguous() if torch.equal(half.float(), full) else None


def _merge_packed(obj, *names: str):
    """The QLinears obj.<names> (same packed format and row length) as ONE PackedWeight of all their rows;
    each QLinear is rebuilt on a row view of it (same values, no extra memory). None if they differ."""
    ws = [getattr(obj, n) for n in names]
    if not all(isinstance(w, QLinear) and len(w.packed.shape) == 2 for w in ws):
        return None
    ps = [w.packed for w in ws]
    if len({(p.qtype, p.K, tuple(p.data)) for p in ps}) != 1:
        return None
    from ds4.kernels.packing import SCALE_COPY_ROW_DIM  # q8_rows's block-major scale copy: rows on dim 1

    dim = {k: SCALE_COPY_ROW_DIM.get(k, 0) for k in ps[0].data}
    merged = type(ps[0])(ps[0].qtype, (sum(p.N for p in ps), ps[0].K), {
        k: torch.cat([p.data[k] for p in ps], dim[k]) for k in ps[0].data
    })  # fmt: skip
    r0 = 0
    for name, w, p in zip(names, ws, ps, strict=True):
        rows = {k: v.narrow(dim[k], r0, p.N) for k, v in merged.data.items()}
        setattr(obj, name, QLinear(w.dense, type(p)(p.qtype, p.shape, rows)))
        r0 += p.N
    return merged


def side_matrices(w, half: bool, merge: bool) -> SideMatrices | None:
    """A layer's SideMatrices (ds4.model.cuda.layer): with `half`, exact float16 copies of the xn-fed
    compressor / indexer matrices, the router, the indexer q_b; with `merge`, q_a + kv and the shared gate +
    up merged into one packed matrix each. None when nothing applies."""
    a = w.attn
    mats = []
    if a.compressor is not None:
        mats = [a.compressor.kv, a.compressor.gate]
        if a.indexer is not None:
            ic = a.indexer.compressor
            mats += [ic.kv, ic.gate, a.indexer.proj]
    xn = _half_copy(mats) if half else None
    q_b = _half_copy([a.indexer.q_b]) if half and a.indexer is not None else None
    router = _half_copy([w.moe.gate_inp]) if half else None
    qa_kv = _merge_packed(a, "q_a", "kv") if merge else None
    shared_gu = _merge_packed(w.moe, "gate_sh", "up_sh") if merge else None
    side = SideMatrices(xn, tuple(m.shape[0] for m in mats), router, q_b, qa_kv, shared_gu)
    return side if any(t is not None for t in (xn, router, q_b, qa_kv, shared_gu)) else None


class DecodeRunner:
    """Static token/pos/logits buffers bound to one state; `step(bound)` replays the decode graph captured for
    that context bound (ctx_bound; None: the whole allocation)."""

    def __init__(self, model: CudaModel, state: DeviceKVState) -> None:
        self.model, self.state = model, state
        dev = model.device
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.logits = torch.zeros(1, model.cfg.n_vocab, dtype=torch.float32, device=dev)
        self.by_bound: dict[int | None, torch.cuda.CUDAGraph] = {}
        self.graph: torch.cuda.CUDAGraph | None = None  # the last one replayed

    def _body(self, bound: int | None = None) -> None:
        self.logits.copy_(self.model.decode_step(self.state, self.token, self.pos, bound))

    def step(self, bound: int | None = None) -> None:
        if not self.model.graphs:
            self._body(bound)
            return
        if bound not in self.by_bound:
            self.by_bound[bound] = self._capture(bound)
        self.graph = self.by_bound[bound]
        self.graph.replay()

    def _capture(self, bound: int | None) -> torch.cuda.CUDAGraph:
        m = self.model
        # The warm-up runs the step for real; putting back what it overwrote (DeviceKVState.step_restorer)
        # lets the replay redo it exactly, without a copy of the whole KV (~14 GB at 1M).
        restore = self.state.step_restorer(self.pos)
        tok, pos = self.token.clone(), self.pos.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(bound)  # first call: lazy constants, cuBLAS handles, allocator warm-up
        torch.cuda.current_stream().wait_stream(side)
        restore()
        graph = m.capture(lambda: self._body(bound))
        self.token.copy_(tok)
        self.pos.copy_(pos)
        return graph


def bucket_of(b: int) -> int:
    """The graph bucket (rows) of a batch of b sessions: the next power of two."""
    return 1 << max(0, b - 1).bit_length()


class BatchRunner:
    """Batched decode over one KVPool: per bucket (rows, context bound: ctx_bound of the deepest row), static
    inputs (slot, token, pos) [3, Bk] and logits [Bk, V] and (on CUDA) a graph captured on them. Rows past
    the batch point at the scratch slot."""

    def __init__(self, model: CudaModel, pool: KVPool) -> None:
        self.model, self.pool = model, pool
        self.buckets: dict[tuple[int, int | None], SimpleNamespace] = {}

    def _bucket(self, n: int, bound: int | None) -> SimpleNamespace:
        bk = self.buckets.get((n, bound))
        if bk is None:
            dev, V = self.model.device, self.model.cfg.n_vocab
            bk = SimpleNamespace(
                inputs=torch.zeros(3, n, dtype=torch.long, device=dev),
                logits=torch.zeros(n, V, dtype=torch.float32, device=dev),
                graph=None,
                bound=bound,
            )
            bk.inputs[0].fill_(self.pool.scratch)
            self.buckets[(n, bound)] = bk
        return bk

    def _body(self, bk: SimpleNamespace) -> None:
        bk.logits.copy_(self.model.decode_step_batch(self.pool, bk.inputs, bk.bound))

    def step(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Logits [B, V] (a copy) of one step; the pool rows of `slots` advance."""
        B = len(slots)
        n = bucket_of(B)
        bk = self._bucket(n, ctx_bound(max(positions) + 1, self.pool.ctx))
        pad = n - B
        host = torch.tensor(
            [slots + [self.pool.scratch] * pad, tokens + [0] * pad, positions + [0] * pad], dtype=torch.long
        )
        if self.model.graphs and bk.graph is None:
            self._capture(bk)
        bk.inputs.copy_(host)
        if bk.graph is not None:
            bk.graph.replay()
        else:
            self._body(bk)
        return bk.logits[:B].clone()

    def _capture(self, bk: SimpleNamespace) -> None:
        """Warm up and capture with every row on the scratch slot: no real session is touched."""
        m = self.model
        bk.inputs.zero_()
        bk.inputs[0].fill_(self.pool.scratch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(bk)  # first call: lazy constants, cuBLAS handles, allocator warm-up
        torch.cuda.current_stream().wait_stream(side)
        bk.graph = m.capture(lambda: self._body(bk))


def _tensors_of(obj) -> list:
    out = []
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif hasattr(v, "data") and isinstance(v.data, torch.Tensor):  # Packed
            out.append(v.data)
        elif isinstance(v, QLinear):
            out += [v.dense, *v.packed.data.values()]
        elif isinstance(getattr(v, "data", None), dict):  # ds4.kernels PackedWeight
            out += list(v.data.values())
        elif hasattr(v, "__dict__"):
            out += _tensors_of(v)
    return out
