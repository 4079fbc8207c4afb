"""Group-wise asymmetric int4 weights: a bf16 scale and offset per group of 32/64/128 input columns, two
nibbles per byte, an eighth of float32's bytes plus the group parameters. Also the layout the
GGUF-native loader (`gguf_quant`) converts GGUF's quantised blocks to."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenops.engine.models.layers import bucket_rows
from tokenops.engine.quantize.common import block_kernels, blocks_amx, has_bf16_tiles, native_ops, probed

INT4_GROUP_SIZES = (32, 64, 128)

# past this many rows the native layer dequantises for one float32 GEMM; the tiles were faster than
# that (dequantising included) at every row count measured, up to here (docs/benchmarks.md)
NATIVE_MAX_ROWS = 4096

# from this many rows, where bf16 runs on AMX's tiles, the native layer dequantises its tiles to bf16
# (one native pass) for one bf16 GEMM: faster than the tiles there on prefill chunks; with AVX512-BF16
# alone (Zen 4) the tiles, two at a time in 512-bit registers, beat it at every row count. Where the
# kernels run the tiles on AMX-INT8 (`blocks_amx()`, with their row groups over chunks of pairs and
# the attention kernel's own tiles keeping every chunk native) a prefill step on them is level with
# the GEMM's near 330 rows; built without that path, up to about 128 (docs/benchmarks.md,
# linear_small_rows.py and engine_prefill_profile.py)
BF16_GEMM_MIN_ROWS = 320
BF16_GEMM_MIN_ROWS_NO_AMX_INT8 = 128


# weight rows the native kernel interleaves (kernels/csrc/linear_blocks.cpp, "tiles")
NATIVE_TILE = 8


def native_blocks(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [out, in'] (0..15) -> the native kernel's tiles, uint8 [ceil(out / 8), in' / 32 * 128]:
    per tile of 8 weight rows and block of 32 inputs, 4 chunks of 32 bytes whose byte 4r + u holds row
    r's input 4c + u (chunk c) in its low nibble and input 16 + 4c + u in its high one; rows past
    `out` are zero."""
    out_f, padded = codes.shape
    tiles = -(-out_f // NATIVE_TILE)
    c = F.pad(codes, (0, 0, 0, tiles * NATIVE_TILE - out_f))
    c = c.view(tiles, NATIVE_TILE, padded // 32, 2, 4, 4)  # [tile, row, block, half, chunk, u]
    b = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # [tile, row, block, chunk, u]
    return b.permute(0, 2, 3, 1, 4).reshape(tiles, -1).contiguous()


def codes_of_native_blocks(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """`native_blocks`' inverse."""
    tiles = packed.shape[0]
    b = packed.view(tiles, -1, 4, NATIVE_TILE, 4)  # [tile, block, chunk, row, u]
    halves = torch.stack([b & 15, b >> 4])  # [half, tile, block, chunk, row, u]
    return halves.permute(1, 4, 2, 0, 3, 5).reshape(tiles * NATIVE_TILE, -1)[:out_features]


def native_params(values: torch.Tensor) -> torch.Tensor:
    """Per-group parameters float [out, groups] -> the tiles' float32 [ceil(out / 8), groups * 8]:
    element 8g + r is row r's (zero past `out`)."""
    out_f, groups = values.shape
    tiles = -(-out_f // NATIVE_TILE)
    v = F.pad(values.float(), (0, 0, 0, tiles * NATIVE_TILE - out_f))
    return v.view(tiles, NATIVE_TILE, groups).transpose(1, 2).reshape(tiles, -1).contiguous()


def params_of_native_params(tiled: torch.Tensor, out_features: int) -> torch.Tensor:
    """`native_params`' inverse."""
    tiles = tiled.shape[0]
    return tiled.view(tiles, -1, NATIVE_TILE).transpose(1, 2).reshape(tiles * NATIVE_TILE, -1)[:out_features]


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (codes uint8 [out, in'] in 0..15, scales, zeros [out, in' / group]).

    Asymmetric per group of `group_size` input columns, in the convention of torch's int4 kernels:
    w = (code - 8) * scale + zero. `in'` is `in` padded with zero columns to a multiple of the group.
    Scales and zeros are rounded to bf16 (what the kernel reads) before the codes are chosen, so the
    codes are the best ones for the stored parameters.
    """
    w = weight.detach().float()
    out_f, in_f = w.shape
    pad = -in_f % group_size
    if pad:
        w = F.pad(w, (0, pad))
    g = w.view(out_f, -1, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16).float()
    zeros = (lo + 8 * scales).to(torch.bfloat16).float()
    codes = torch.round((g - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15).to(torch.uint8)
    return codes.view(out_f, -1), scales, zeros


def dequantize_int4(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The float weight [out, in'] that `quantize_int4`'s output stands for."""
    out_f = codes.shape[0]
    g = codes.view(out_f, scales.shape[1], -1).to(dtype)
    return ((g - 8) * scales[..., None].to(dtype) + zeros[..., None].to(dtype)).view(out_f, -1)


def _has_int4pack_kernel(device: torch.device) -> bool:
    """CPU builds of torch >= 2.5 have `_weight_int4pack_mm_for_cpu` (bf16 activations)."""
    if device.type != "cpu":
        return False
    try:
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 32, dtype=torch.int32), 1)
        sz = torch.zeros(1, 16, 2, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, 32, dtype=torch.bfloat16), w, 32, sz)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def has_int4pack_kernel(device: torch.device | str) -> bool:
    device = torch.device(device)
    return probed(f"int4:{device}", lambda: _has_int4pack_kernel(device))


def bf16_gemm_min_rows() -> int:
    """The fewest rows that take one bf16 GEMM over the dequantised tiles where bf16 runs on AMX."""
    return BF16_GEMM_MIN_ROWS if blocks_amx() else BF16_GEMM_MIN_ROWS_NO_AMX_INT8


def takes_tiles(x: torch.Tensor, rows: int) -> bool:
    """Whether `rows` rows of x, on the native kernels, take `linear_q4`'s tiles rather than one bf16
    GEMM over the dequantised tiles (many rows where bf16 runs on AMX)."""
    return not has_bf16_tiles(x.device) or rows < bf16_gemm_min_rows()


class Int4WeightOnlyLinear(nn.Module):
    """y = x @ dequant(codes).T + bias, int4 codes two per byte, asymmetric per group of inputs.

    On a CPU with torch's int4 kernel (and out_features a multiple of 16, its tile) the codes are
    kept in the kernel's tiled layout and every call is one `_weight_int4pack_mm_for_cpu` on bf16
    activations: nothing is dequantised in memory. Otherwise the codes are kept as plain nibbles
    (low nibble = even column) and dequantised to the activation dtype for an ordinary GEMM.
    Inputs whose width is not a multiple of the group are zero-padded (the padded weight columns
    are zero too).

    Where `common.block_kernels` holds (the AVX2 feature set, or a build with `vpdpbusd`), the codes
    are kept in the native kernel's tiles of 8 interleaved rows (`native_blocks`) with w = code * d + m
    parameters, float16 where that holds them exactly (a GGUF file's Q4_0 / Q4_1 ones), else float32,
    and up to
    NATIVE_MAX_ROWS float32 rows run `tokenops::linear_q4`: activations quantised to int8 per block
    of 32 as llama.cpp's Q8_1, integer products (docs/engine-core.md); where bf16 runs on AMX's tiles
    (`common.has_bf16_tiles`), calls of BF16_GEMM_MIN_ROWS rows or more instead dequantise the tiles to
    bf16 (`tokenops::dequantize_q4_bf16`) for one bf16 GEMM on bf16 activations, output cast back to
    `out_dtype` (the float layer's dtype), or kept in bf16 where `keeps_bf16` says the next op reads
    bf16 (as `Bf16Linear`'s: a gated MLP's gate|up projection, whose [T, 2I] output would otherwise
    be cast to float32 for the activation and back to bf16 for the down projection's GEMM).
    """

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.out_features = codes.shape[0]
        self.out_dtype = out_dtype  # what the bf16 GEMM's output is cast to (None: the input's dtype)
        # set by `quantize` on a gated MLP's gate|up projection (the bf16 GEMM's output is handed on
        # uncast, the activation reads and writes bf16 and the down projection needs no cast in) and on
        # a Llama layer's output projections (its norms widen their output as they add it)
        self.keeps_bf16 = False
        self.in_features = in_features
        self.padded_in = codes.shape[1]
        self.group_size = self.padded_in // scales.shape[1]
        self.native = block_kernels(codes.device) and self.padded_in % 32 == 0
        self.kernel = not self.native and has_int4pack_kernel(codes.device) and self.out_features % 16 == 0
        if self.native:
            packed = native_blocks(codes)
            # [(d, m), tiles, groups * 8]: w = code * d + m, each half contiguous as the kernel reads it
            d, m = scales.float(), zeros.float() - 8 * scales.float()
            params = torch.stack([native_params(d), native_params(m)]).contiguous()
            # a GGUF file's Q4_0 / Q4_1 parameters are float16 values: kept so, a one-row step streams
            # 20 bytes per 32 weights instead of 24 (llama.cpp's own); any other set stays float32
            half = params.half()
            if torch.equal(half.float(), params):
                params = half
        elif self.kernel:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            # the kernel reads [groups, out, (scale, zero)]
            params = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        else:
            packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
            params = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()
        self.register_buffer("weight_packed", packed.contiguous())  # uint8 [out, in' / 2]
        self.register_buffer("scales_and_zeros", params)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32) -> Int4WeightOnlyLinear:
        codes, scales, zeros = quantize_int4(linear.weight, group_size)
        return cls(codes, scales, zeros, linear.in_features, linear.bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        w_bf16 = None  # the tiles dequantised for one bf16 GEMM, on many rows where those win
        if self.native:
            # the kernel takes any leading dims; a decode step calls this 4 times a layer, so the
            # parameter views are cut once, not per call (a tuple unpack of the buffer is an unbind)
            rows = x.numel() // max(shape[-1], 1)
            # bf16 activations come from a `keeps_bf16` projection's bf16 GEMM, on as many rows
            ops = native_ops(x, rows, NATIVE_MAX_ROWS, (torch.float32, torch.bfloat16))
            if ops is not None:
                d, m, bias = self._native_args()
                if takes_tiles(x, rows):
                    xf = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
                    out = ops.linear_q4(
                        xf, self.weight_packed, d, m, self.out_features, self.group_size, bias
                    )
                    return out if x.dtype == torch.float32 else out.to(self.out_dtype or x.dtype)
                w_bf16 = ops.dequantize_q4_bf16(self.weight_packed, d, m, self.out_features, self.group_size)
        x2 = x.reshape(-1, self.in_features)
        if self.padded_in != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in - self.in_features))
        if w_bf16 is not None:
            out = F.linear(bucket_rows(x2, torch.bfloat16), w_bf16)[: x2.shape[0]]
            if not self.keeps_bf16:
                out = out.to(self.out_dtype or x.dtype)
        elif self.kernel:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16), self.weight_packed, self.group_size, self.scales_and_zeros
            ).to(x.dtype)
        else:
            out = F.linear(x2, self._dequantized(x.dtype))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this gate|up projection in one native pass (`linear_q4_silu_mul`, the same
        bits as `silu_mul(forward(x))`) where `forward` would take the tiles: float32 x, no bias; else
        None, and the caller runs the two."""
        if not self.native or self.bias is not None or self.out_features % 2:
            return None
        rows = x.numel() // max(x.shape[-1], 1)
        ops = native_ops(x, rows, NATIVE_MAX_ROWS)
        if ops is None or not takes_tiles(x, rows):
            return None
        d, m, _ = self._native_args()
        return ops.linear_q4_silu_mul(
            x.contiguous(), self.weight_packed, d, m, self.out_features, self.group_size
        )

    def input_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype `forward` computes x's rows in: bf16 where they take the bf16 GEMM over the
        dequantised tiles and the output keeps a dtype of its own (a producer may write them in bf16,
        the cast this layer would make), else x's."""
        rows = x.numel() // max(x.shape[-1], 1)
        wide = (
            self.native
            and (self.keeps_bf16 or self.out_dtype is not None)
            and native_ops(x, rows, NATIVE_MAX_ROWS, (torch.float32, torch.bfloat16)) is not None
            and not takes_tiles(x, rows)
        )
        return torch.bfloat16 if wide else x.dtype

    def _native_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(d, m, float32 bias) for `linear_q4`, cut again when `.to()` or loading replaced a buffer."""
        sz, bias = self.scales_and_zeros, self.bias
        cached = self.__dict__.get("_native_cache")
        if cached is None or cached[0] is not sz or cached[1] is not bias:
            cached = self.__dict__["_native_cache"] = (sz, bias, (sz[0], sz[1]))
        d, m = cached[2]
        # a float32 bias is passed as is (a copy would miss an in-place load)
        return d, m, None if bias is None else bias.float()

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        p, sz = self.weight_packed, self.scales_and_zeros
        if self.native:
            out_f = self.out_features
            d, m = (params_of_native_params(t, out_f)[..., None].to(dtype) for t in sz)
            g = codes_of_native_blocks(p, out_f).view(out_f, d.shape[1], -1).to(dtype)
            return (g * d + m).view(out_f, -1)
        codes = torch.stack([p & 15, p >> 4], dim=-1).view(self.out_features, self.padded_in)
        return dequantize_int4(codes, sz[..., 0], sz[..., 1], dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, kernel={self.kernel}, native={self.native}"
        )
