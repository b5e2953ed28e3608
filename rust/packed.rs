//! Packed 4- and 8-bit weights back to BF16 or F16, each element as the reference code
//! computes it (docs/rounding.md, "Packed 4-/8-bit in", derives every step from the sources):
//!
//! - compressed-tensors 0.19 `nvfp4-pack-quantized` (`nvfp4`): two E2M1 codes per byte, an
//!   E4M3 scale per 16, an F32 global scale; `mxfp4-pack-quantized` (`mxfp4`): an E8M0
//!   (`U8`) scale per 32. Their own result is BF16; F16 is that BF16 `.to(torch.float16)`.
//! - compressed-tensors `pack-quantized` INT1..8 codes densely packed in I32 words, and
//!   `int-quantized`/`naive-quantized` I8 (`int`): `(q - zp) * s` in the scale's dtype S,
//!   then `.to(T)`; per tensor, per channel or per group of columns; zero points packed
//!   along rows (`pack-quantized`) or plain I8 shaped as the scale.
//! - gpt-oss MXFP4 blocks (`*_blocks` `[.., rows, cols/32, 16]`, `*_scales`
//!   `[.., rows, cols/32]`), as transformers 5.17's `convert_moe_packed_tensors(dtype=T)`
//!   (`gptoss`, `gptoss_transposed`): `T(v * 2^(e-127))`, the exact product rounded once.
//!
//! Every function converts one window (whole rows, or whole groups of a row), so a caller
//! bounds memory by the window it picks; results do not depend on the window. The float
//! work runs under `fp8::FpEnv` (no flush-to-zero whatever the caller set). Targets other
//! than BF16 and F16, and buffers of the wrong size, write nothing past the shorter side
//! (never a panic); sizes are the caller's to check (`debug_assert`ed here).

use safetensors::tensor::Dtype;

pub use crate::fp8::e8m0;
use crate::fp8::{e4m3_to_f32, FpEnv};
use crate::kernels::{
    bf16_from_f32, bf16_from_f64, f16_from_bf16, f16_from_f32, f16_from_f64, f32_from_f16,
};

/// E2M1 (FP4) code values, as compressed-tensors' `kE2M1ToFloat` times the sign and
/// transformers' `FP4_VALUES` give them (code 8 is -0.0).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// NVFP4's group: 16 codes per E4M3 scale.
pub const NVFP4_GROUP: usize = 16;
/// MXFP4's group (compressed-tensors and gpt-oss): 32 codes per E8M0 scale.
pub const MXFP4_GROUP: usize = 32;

/// Rounds an f32 to BF16 and back (exact), as torch stores a BF16 result of f32 arithmetic.
#[inline(always)]
fn round_bf16(x: f32) -> f32 {
    f32::from_bits(u32::from(bf16_from_f32(x.to_bits())) << 16)
}

/// Rounds an f32 to F16 and back (exact).
#[inline(always)]
fn round_f16(x: f32) -> f32 {
    f32::from_bits(f32_from_f16(f16_from_f32(x.to_bits())))
}

/// A BF16 result (exactly a BF16 value, as f32) in the target: itself, or `.to(float16)`.
#[inline(always)]
fn bf16_result_to(target: Dtype) -> Option<fn(f32) -> u16> {
    match target {
        Dtype::BF16 => Some(|p| bf16_from_f32(p.to_bits())),
        Dtype::F16 => Some(|p| f16_from_bf16(bf16_from_f32(p.to_bits()))),
        _ => None,
    }
}

/// An NVFP4 weight's global scale. Its rank decides, by torch's type promotion, the dtype in
/// which compressed-tensors' `scale / global_scale` is computed (and then the product).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GlobalScale {
    /// A tensor of rank >= 1 (`[1]`, what llm-compressor writes): F32 wins over the BF16
    /// scale, so the division and the product are f32, and only the result is rounded to BF16.
    Tensor(f32),
    /// A rank-0 tensor: it does not take part in promotion, so both are BF16 (each f32
    /// result rounded to BF16).
    Scalar(f32),
}

/// NVFP4 (`nvfp4-pack-quantized`) rows to `target` (BF16 or F16), as compressed-tensors
/// 0.19's `NVFP4PackedCompressor.decompress` with `.to(target)`:
///
/// ```text
/// v = E2M1[code]                        unpack_fp4_from_uint8: f32 table, .to(bf16): exact
/// s = f32(e4m3)                         weight_scale.to(bf16): exact
/// Tensor(g): out = bf16(f32(v) * f32(s / g))          f32 division, f32 product
/// Scalar(g): out = bf16(v * bf16(s / g))              each rounded to bf16
/// F16 target: f16(out)                  the bf16 result .to(float16)
/// ```
///
/// `packed` holds n rows of `cols / 2` bytes (low nibble first), `scales` the same n rows of
/// `cols / 16` E4M3 bytes, `dst` n rows of `cols` little-endian target elements. `cols`
/// must be a positive multiple of 16 (the reference refuses other widths), else nothing is
/// written.
pub fn nvfp4(
    cols: usize,
    packed: &[u8],
    scales: &[u8],
    global: GlobalScale,
    target: Dtype,
    dst: &mut [u8],
) {
    let Some(out) = bf16_result_to(target) else {
        return;
    };
    let _env = FpEnv::enter();
    match global {
        GlobalScale::Tensor(g) => fp4_rows(
            cols,
            NVFP4_GROUP,
            packed,
            scales,
            dst,
            |b| e4m3_to_f32(b) / g,
            |v, s| out(v * s),
        ),
        GlobalScale::Scalar(g) => fp4_rows(
            cols,
            NVFP4_GROUP,
            packed,
            scales,
            dst,
            |b| round_bf16(e4m3_to_f32(b) / g),
            |v, s| out(round_bf16(v * s)),
        ),
    }
}

/// MXFP4 (`mxfp4-pack-quantized`) rows to `target`, as compressed-tensors 0.19's
/// `MXFP4PackedCompressor.decompress` with `.to(target)`: `s = 2^(b - 127)` in BF16
/// (`e8m0`), `out = bf16(v * s)` (BF16 tensors multiply in f32, rounded to BF16), F16 the
/// BF16 result `.to(float16)`. `packed`: n rows of `cols / 2` bytes; `scales`: n rows of
/// `cols / 32` bytes; `dst`: n rows of `cols` elements; `cols` a positive multiple of 32.
pub fn mxfp4(cols: usize, packed: &[u8], scales: &[u8], target: Dtype, dst: &mut [u8]) {
    let Some(out) = bf16_result_to(target) else {
        return;
    };
    let _env = FpEnv::enter();
    fp4_rows(cols, MXFP4_GROUP, packed, scales, dst, e8m0, |v, s| {
        out(round_bf16(v * s))
    });
}

/// The FP4 row loop: one scale byte per `group` codes, `scale` decodes it, `value` makes the
/// target bits of code value `v` and decoded scale `s`.
#[inline(always)]
fn fp4_rows<S: Copy>(
    cols: usize,
    group: usize,
    packed: &[u8],
    scales: &[u8],
    dst: &mut [u8],
    scale: impl Fn(u8) -> S,
    value: impl Fn(f32, S) -> u16,
) {
    if cols == 0 || !cols.is_multiple_of(group) {
        return;
    }
    let groups = cols / group;
    let n = packed.len() / (cols / 2);
    debug_assert_eq!(packed.len(), n * cols / 2, "packed holds whole rows");
    debug_assert_eq!(scales.len(), n * groups, "scales hold the rows' groups");
    debug_assert_eq!(dst.len(), n * cols * 2, "dst holds the rows");
    let pairs = dst.as_chunks_mut::<4>().0;
    for ((bytes, &sb), out) in packed
        .chunks_exact(group / 2)
        .zip(scales)
        .zip(pairs.chunks_mut(group / 2))
    {
        let s = scale(sb);
        for (&b, o) in bytes.iter().zip(out.iter_mut()) {
            let lo = value(E2M1[usize::from(b & 0x0F)], s).to_le_bytes();
            let hi = value(E2M1[usize::from(b >> 4)], s).to_le_bytes();
            *o = [lo[0], lo[1], hi[0], hi[1]];
        }
    }
}

/// The value of gpt-oss E8M0 byte `b` in transformers' `ldexp`: `2^(b - 127)` exactly,
/// 2^128 included (f64 holds it). torch 2.14's CPU `ldexp` behaves as the exact product
/// `v * 2^(b-127)` rounded once to the output dtype: with byte 255 the fixtures hold 2^127
/// for code 0.5 and 0 for code 0 (an f32 power 2^128 would overflow to inf and give NaN).
#[inline(always)]
fn gptoss_scale(b: u8) -> f64 {
    f64::from_bits((u64::from(b) + 896) << 52)
}

/// The target bits of a gpt-oss element: `T(v * 2^(e-127))`, the exact product (an f64
/// product of an E2M1 value and a power of two, exact over every byte) rounded once to T
/// (RNE, overflow to inf), as transformers' `torch.ldexp(sub, exp, out=sub)` gives it.
fn gptoss_value(target: Dtype) -> Option<fn(f32, f64) -> u16> {
    match target {
        Dtype::BF16 => Some(|v, s| bf16_from_f64((f64::from(v) * s).to_bits())),
        Dtype::F16 => Some(|v, s| f16_from_f64((f64::from(v) * s).to_bits())),
        _ => None,
    }
}

/// gpt-oss MXFP4 block rows to `target` (BF16 or F16), as transformers 5.17's
/// `convert_moe_packed_tensors(blocks, scales, dtype=target)` before its final transpose:
/// `blocks` holds n rows of 16 bytes (32 codes, low nibble first), `scales` n E8M0 bytes,
/// `dst` n rows of 32 target elements (row-major `[.., rows, cols]`).
pub fn gptoss(blocks: &[u8], scales: &[u8], target: Dtype, dst: &mut [u8]) {
    let Some(value) = gptoss_value(target) else {
        return;
    };
    let _env = FpEnv::enter();
    debug_assert_eq!(blocks.len(), 16 * scales.len(), "16 bytes per scale");
    debug_assert_eq!(dst.len(), 64 * scales.len(), "32 elements per scale");
    fp4_rows(
        MXFP4_GROUP,
        MXFP4_GROUP,
        blocks,
        scales,
        dst,
        gptoss_scale,
        value,
    );
}

/// gpt-oss blocks of one expert to the layout transformers' dequantized gpt-oss holds
/// (`convert_moe_packed_tensors` ends in `.transpose(1, 2)`: `[E, rows, cols]` becomes
/// `[E, cols, rows]`), a window of whole groups at a time: `blocks` holds, for each of the
/// expert's `rows` rows, `groups` consecutive groups of 16 bytes (`[rows, groups, 16]`),
/// `scales` their bytes (`[rows, groups]`); `dst` receives the `32 * groups` output rows those
/// groups make, each `rows` elements long. The values are `gptoss`'s.
pub fn gptoss_transposed(
    rows: usize,
    groups: usize,
    blocks: &[u8],
    scales: &[u8],
    target: Dtype,
    dst: &mut [u8],
) {
    let Some(value) = gptoss_value(target) else {
        return;
    };
    debug_assert_eq!(blocks.len(), rows * groups * 16);
    debug_assert_eq!(scales.len(), rows * groups);
    debug_assert_eq!(dst.len(), rows * groups * 64);
    if blocks.len() < rows * groups * 16 || scales.len() < rows * groups {
        return;
    }
    let _env = FpEnv::enter();
    let out = dst.as_chunks_mut::<2>().0;
    for r in 0..rows {
        for g in 0..groups {
            let s = gptoss_scale(scales[r * groups + g]);
            let block = &blocks[(r * groups + g) * 16..][..16];
            for (j, &b) in block.iter().enumerate() {
                let c = g * 32 + 2 * j;
                if let Some(o) = out.get_mut(c * rows + r) {
                    *o = value(E2M1[usize::from(b & 0x0F)], s).to_le_bytes();
                }
                if let Some(o) = out.get_mut((c + 1) * rows + r) {
                    *o = value(E2M1[usize::from(b >> 4)], s).to_le_bytes();
                }
            }
        }
    }
}

/// Which scale (and zero point) an element of an integer-quantized weight uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntLayout {
    /// One for the tensor (`[1]`).
    Tensor,
    /// One per row (`[O, 1]`).
    Channel,
    /// One per run of this many columns of a row (`[O, I / size]`, `size` dividing I).
    Group(usize),
}

/// An integer weight's codes, for the window's rows.
#[derive(Clone, Copy, Debug)]
pub enum Codes<'a> {
    /// `pack-quantized`: each row `ceil(cols * bits / 32)` little-endian I32 words; code `c`
    /// of a row is the `bits` bits at bit `c * bits` (spanning two words where `bits` does
    /// not divide 32), stored with the offset `2^(bits-1)` added.
    Packed { bits: u32, words: &'a [u8] },
    /// `int-quantized` / `naive-quantized`: one I8 per code.
    I8(&'a [u8]),
}

/// An integer weight's zero points: the WHOLE zero-point tensor.
#[derive(Clone, Copy, Debug)]
pub enum ZeroPoints<'a> {
    /// `pack-quantized`: `[ceil(O * bits / 32), G]` I32, packed along rows (column `g` holds
    /// group g's zero points of every row, densely, as `Codes::Packed` packs a row).
    PackedRows {
        bits: u32,
        groups: usize,
        data: &'a [u8],
    },
    /// Plain I8, shaped as the scale.
    I8(&'a [u8]),
}

/// Bit-field `i` of `bits` bits of a run of little-endian I32 words (`word(k)` reads word
/// k), the offset `2^(bits-1)` removed: compressed-tensors 0.19's `unpack_from_int32` (bit
/// `i * bits` on; a field spans two words where `bits` does not divide 32). None past the
/// words.
#[inline(always)]
fn field(word: impl Fn(usize) -> Option<u32>, bits: u32, i: usize) -> Option<i32> {
    let p = i.checked_mul(bits as usize)?;
    let (k, off) = (p / 32, (p % 32) as u32);
    let lo = (32 - off).min(bits);
    let mut v = (word(k)? >> off) & ((1u32 << lo) - 1);
    if lo < bits {
        v |= (word(k + 1)? & ((1u32 << (bits - lo)) - 1)) << lo;
    }
    Some(v as i32 - (1 << (bits - 1)))
}

/// Word `k` of little-endian I32 `data` whose words are `stride` apart, from word `first`.
#[inline(always)]
fn word_at(data: &[u8], first: usize, stride: usize, k: usize) -> Option<u32> {
    let at = k.checked_mul(stride)?.checked_add(first)?.checked_mul(4)?;
    Some(u32::from_le_bytes(*data.get(at..)?.first_chunk()?))
}

impl ZeroPoints<'_> {
    /// Zero point `i` of the scale tensor (row `i / groups`, group `i % groups`), or None.
    fn at(&self, i: usize, groups: usize) -> Option<i32> {
        match *self {
            ZeroPoints::PackedRows {
                bits,
                groups: g,
                data,
            } => {
                // Column `i % G` of the row-major [words, G] tensor holds that group's zero
                // points of every row, packed as a row of codes is.
                (g == groups).then_some(())?;
                field(|k| word_at(data, i % g, g, k), bits, i / g)
            }
            ZeroPoints::I8(d) => d.get(i).map(|&b| i32::from(b as i8)),
        }
    }
}

/// A scale dtype S: its byte size and the f32 of its little-endian bytes.
type ScaleReader = (usize, fn(&[u8]) -> f32);

/// Integer-quantized rows to `target` (BF16 or F16), as compressed-tensors 0.19's
/// `PackedQuantizationCompressor.decompress` (and `NaiveQuantizationCompressor`'s) with
/// `.to(target)`, in the scale's dtype S (F32, BF16 or F16):
///
/// ```text
/// q   = the code (int8)                       unpack_from_int32 / the I8 tensor
/// x   = round_S(f32(q) - f32(zp))             q.to(S) - zp.to(S): exact (|x| <= 255)
/// out = T(round_S(x * f32(s)))                * scale in S, .to(S), then .to(T)
/// ```
///
/// The window is `n` whole rows starting at row `row0` of a weight `cols` wide; `scales` is
/// the WHOLE scale tensor (little-endian S), `zero_points` the whole zero-point tensor (None
/// when symmetric); `dst` n rows of `cols` target elements. A scale or zero point the tensor
/// lacks, or a code past the packed words, gives NaN (never a panic). Nothing is written for
/// another S or target, `cols == 0`, a group size not dividing `cols`, or bits outside 1..=8.
#[allow(clippy::too_many_arguments)]
pub fn int(
    layout: IntLayout,
    cols: usize,
    row0: usize,
    codes: Codes<'_>,
    s_dtype: Dtype,
    scales: &[u8],
    zero_points: Option<ZeroPoints<'_>>,
    target: Dtype,
    dst: &mut [u8],
) {
    let groups = match layout {
        IntLayout::Tensor | IntLayout::Channel => 1,
        IntLayout::Group(0) => return,
        IntLayout::Group(g) if !cols.is_multiple_of(g) => return,
        IntLayout::Group(g) => cols / g,
    };
    if cols == 0 {
        return;
    }
    let (size, read): ScaleReader = match s_dtype {
        Dtype::F32 => (4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::BF16 => (2, |b| {
            f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
        }),
        Dtype::F16 => (2, |b| {
            f32::from_bits(f32_from_f16(u16::from_le_bytes([b[0], b[1]])))
        }),
        _ => return,
    };
    let row_codes = match codes {
        Codes::Packed { bits, .. } if !(1..=8).contains(&bits) => return,
        Codes::Packed { bits, .. } => (cols * bits as usize).div_ceil(32) * 4,
        Codes::I8(_) => cols,
    };
    let a = IntRows {
        layout,
        cols,
        groups,
        row0,
        codes,
        row_codes,
        scales,
        size,
        read,
        zero_points,
    };
    let _env = FpEnv::enter();
    let (bf16_out, f16_out) = (
        |p: f32| bf16_from_f32(p.to_bits()),
        |p: f32| f16_from_f32(p.to_bits()),
    );
    // One instance per (S, T): the rounding inlines into the element loops.
    match (s_dtype, target) {
        (Dtype::F32, Dtype::BF16) => int_rows(&a, dst, |x| x, bf16_out),
        (Dtype::F32, Dtype::F16) => int_rows(&a, dst, |x| x, f16_out),
        (Dtype::BF16, Dtype::BF16) => int_rows(&a, dst, round_bf16, bf16_out),
        (Dtype::BF16, Dtype::F16) => int_rows(&a, dst, round_bf16, f16_out),
        (Dtype::F16, Dtype::BF16) => int_rows(&a, dst, round_f16, bf16_out),
        (Dtype::F16, Dtype::F16) => int_rows(&a, dst, round_f16, f16_out),
        _ => {}
    }
}

/// What `int` checked, for its row loop.
struct IntRows<'a> {
    layout: IntLayout,
    cols: usize,
    groups: usize,
    row0: usize,
    codes: Codes<'a>,
    /// Bytes of codes per row.
    row_codes: usize,
    scales: &'a [u8],
    size: usize,
    read: fn(&[u8]) -> f32,
    zero_points: Option<ZeroPoints<'a>>,
}

/// `int`'s row loop: `round` rounds an f32 to S, `out` an S value to the target's bits.
#[inline(always)]
fn int_rows(a: &IntRows<'_>, dst: &mut [u8], round: impl Fn(f32) -> f32, out: impl Fn(f32) -> u16) {
    let (cols, groups, size) = (a.cols, a.groups, a.size);
    let scale = |i: usize| {
        let at = i
            .checked_mul(size)
            .and_then(|k| a.scales.get(k..)?.get(..size));
        at.map_or(f32::NAN, a.read)
    };
    let zero = |i: usize| {
        a.zero_points
            .map(|z| z.at(i, groups).map_or(f32::NAN, |v| v as f32))
    };
    let group = cols / groups;
    // One row of codes as f32 (exact), reused: the row's width, never more.
    let mut q_row = vec![0f32; if dst.len() >= 2 * cols { cols } else { 0 }];
    let rc = a.row_codes;
    for (r, drow) in dst.chunks_exact_mut(2 * cols).enumerate() {
        let row = a.row0.saturating_add(r);
        let code_row = match a.codes {
            Codes::Packed { words, .. } => words.get(r * rc..(r + 1) * rc),
            Codes::I8(b) => b.get(r * rc..(r + 1) * rc),
        };
        let Some(code_row) = code_row else { return };
        match a.codes {
            Codes::Packed { bits, .. } => unpack_row(code_row, bits, &mut q_row),
            Codes::I8(_) => {
                for (q, &b) in q_row.iter_mut().zip(code_row) {
                    *q = f32::from(b as i8);
                }
            }
        }
        for (g, (dg, qg)) in drow
            .chunks_exact_mut(2 * group)
            .zip(q_row.chunks_exact(group))
            .enumerate()
        {
            let i = match a.layout {
                IntLayout::Tensor => 0,
                _ => row.saturating_mul(groups).saturating_add(g),
            };
            let s = scale(i);
            let o = dg.as_chunks_mut::<2>().0;
            match zero(i) {
                Some(z) => {
                    for (o, &q) in o.iter_mut().zip(qg) {
                        *o = out(round(round(q - z) * s)).to_le_bytes();
                    }
                }
                None => {
                    for (o, &q) in o.iter_mut().zip(qg) {
                        *o = out(round(q * s)).to_le_bytes();
                    }
                }
            }
        }
    }
}

/// The codes of one packed row (`ceil(cols * bits / 32)` words) as f32, into `q` (`cols`
/// long): word by word where `bits` divides 32 (no field spans two words), else field by
/// field (`field`). A code past the words reads as NaN.
fn unpack_row(words: &[u8], bits: u32, q: &mut [f32]) {
    if 32 % bits == 0 {
        let per = (32 / bits) as usize;
        let (mask, offset) = ((1u32 << bits) - 1, 1i32 << (bits - 1));
        let mut chunks = q.chunks_mut(per);
        for (w, chunk) in words.as_chunks::<4>().0.iter().zip(&mut chunks) {
            let w = u32::from_le_bytes(*w);
            for (j, q) in chunk.iter_mut().enumerate() {
                *q = (((w >> (j as u32 * bits)) & mask) as i32 - offset) as f32;
            }
        }
        chunks.flatten().for_each(|q| *q = f32::NAN);
    } else {
        for (c, q) in q.iter_mut().enumerate() {
            *q = field(|k| word_at(words, 0, 1, k), bits, c).map_or(f32::NAN, |v| v as f32);
        }
    }
}

#[cfg(test)]
mod tests;
