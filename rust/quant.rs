//! FP8 targets: which weights are quantized, how their groups and scales are laid out, and
//! the warnings vLLM's constraints call for. The arithmetic is `fp8`'s.
//!
//! The rule (stcast's, close to llm-compressor's `model_free_ptq`, see docs/guide.md): a
//! tensor is quantized when it is a 2-D F32, F16 or BF16 tensor named `*.weight`, not kept
//! by a `keep` pattern, and its module is none of: a norm (a name ending in `norm`, any
//! case), an embedding, the output head, a MoE router gate. 3-D fused experts stay BF16.

use safetensors::tensor::Dtype;

use crate::error::Fp8Problem;
use crate::vocab::{Fp8Skip, Strategy};

/// Rows and columns of one FP8 block.
pub const BLOCK: u64 = 128;

/// The largest group, in source bytes, a window may have to hold whole (one row, or one
/// band of 128 rows): a bound on memory whatever the weight.
pub const MAX_GROUP: u64 = 48 << 20;

/// How one weight is quantized: its dtype D (of the source and the scale), its strategy and
/// its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quant {
    pub d: Dtype,
    pub strategy: Strategy,
    pub rows: u64,
    pub cols: u64,
}

impl Quant {
    /// Bytes per source element (and per scale).
    pub fn size(&self) -> u64 {
        (self.d.bitsize() / 8) as u64
    }

    /// Source bytes of one group of rows: a row per channel, a band of 128 rows per block.
    pub fn granule(&self) -> u64 {
        let rows = match self.strategy {
            Strategy::Channel => 1,
            Strategy::Block => BLOCK,
        };
        rows * self.cols * self.size()
    }

    /// The scale tensor's shape: `[O, 1]` per channel, `[ceil(O/128), ceil(I/128)]` per block.
    pub fn scale_shape(&self) -> [usize; 2] {
        match self.strategy {
            Strategy::Channel => [self.rows as usize, 1],
            Strategy::Block => [
                self.rows.div_ceil(BLOCK) as usize,
                self.cols.div_ceil(BLOCK) as usize,
            ],
        }
    }

    /// The scale tensor's bytes.
    pub fn scale_len(&self) -> u64 {
        let [a, b] = self.scale_shape();
        (a * b) as u64 * self.size()
    }

    /// Scales (in elements) per group of rows (`granule`): 1 per row, a row of tiles per band.
    pub fn scales_per_granule(&self) -> u64 {
        match self.strategy {
            Strategy::Channel => 1,
            Strategy::Block => self.cols.div_ceil(BLOCK),
        }
    }
}

/// One weight an FP8 target quantized, and what that did to its values.
#[derive(Clone, Debug, serde::Serialize)]
pub struct QuantizedTensor {
    pub name: String,
    pub strategy: Strategy,
    /// The scale's dtype (the weight's).
    pub scale_dtype: String,
    pub elements: u64,
    pub groups: u64,
    /// Groups whose values are all zero (their scale is the dtype's eps).
    pub zero_groups: u64,
    /// Non-zero values that became zero.
    pub flushed: u64,
    /// The largest |dequantized - source|, and the error's norm over the source's.
    pub max_abs_error: f64,
    pub rel_error: f64,
}

impl QuantizedTensor {
    pub fn new(name: String, q: Quant, st: &crate::fp8::Fp8Stats) -> QuantizedTensor {
        QuantizedTensor {
            name,
            strategy: q.strategy,
            scale_dtype: q.d.to_string(),
            elements: st.elements,
            groups: st.groups,
            zero_groups: st.zero_groups,
            flushed: st.flushed,
            max_abs_error: st.max_abs_err,
            rel_error: st.rel_err(),
        }
    }
}

/// How a quantized input's weight maps to its scales (and zero points, shaped alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// One scale for the whole tensor (`[]` or a one-element `[1]`, `[1, 1]`).
    Tensor,
    /// One per row (`[O, 1]`).
    Channel,
    /// One per 128x128 tile (`[ceil(O/128), ceil(I/128)]`).
    Block,
    /// One per run of this many columns of a row (`[O, I / size]`, `size` dividing I).
    Group(u64),
}

/// An FP8 input weight's zero point: input tensor `tensor` of dtype `dtype`, shaped as the
/// scale (compressed-tensors' asymmetric schemes: `(q - zp) * s`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroPoint {
    pub tensor: usize,
    pub dtype: Dtype,
}

/// How a quantized input weight's codes are stored (`Deq::packing`); the arithmetic of
/// each is `fp8::dequantize`'s (`dequantize_once`'s for a `weight_scale_inv`) or `packed`'s
/// (docs/rounding.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    /// F8_E4M3, a code a byte (compressed-tensors float 8-bit, DeepSeek fp8).
    Fp8,
    /// compressed-tensors `nvfp4-pack-quantized`: two E2M1 codes a byte, an E4M3 scale per
    /// 16, and the F32 global scale, input tensor `global` (`scalar`: of rank 0).
    Nvfp4 { global: usize, scalar: bool },
    /// compressed-tensors `mxfp4-pack-quantized`: an E8M0 (U8) scale per 32.
    Mxfp4,
    /// compressed-tensors `pack-quantized`: `bits`-bit codes in I32 words, each row
    /// `ceil(cols * bits / 32)` words; zero points packed along rows.
    Int { bits: u32 },
    /// compressed-tensors `int-quantized`/`naive-quantized`: an I8 code a byte.
    I8,
    /// gpt-oss MXFP4 `X_blocks` `[experts, rows, cols / 32, 16]` with `X_scales`
    /// `[experts, rows, cols / 32]`: out comes `X` `[experts, cols, rows]`.
    GptOss { experts: u64 },
}

/// The suffix of a compressed-tensors packed weight (`X.weight_packed` becomes `X.weight`).
pub const PACKED_SUFFIX: &str = "_packed";
/// The suffixes of a gpt-oss MXFP4 weight and its scales (`X_blocks` + `X_scales` become `X`).
pub const BLOCKS_SUFFIX: &str = "_blocks";
pub const SCALES_SUFFIX: &str = "_scales";
/// The suffix of an NVFP4 weight's global scale (`X.weight_global_scale`).
pub const GLOBAL_SCALE_SUFFIX: &str = "_global_scale";

/// A quantized input weight to dequantize: `rows x cols` codes (per expert for gpt-oss),
/// stored as `packing` says, its scale (input tensor `scale`, of dtype `s_dtype`) and zero
/// point if it has one, the target dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deq {
    pub scale: usize,
    pub s_dtype: Dtype,
    pub zero_point: Option<ZeroPoint>,
    pub layout: Layout,
    pub rows: u64,
    pub cols: u64,
    pub target: Dtype,
    pub packing: Packing,
    /// Its scale is a `weight_scale_inv` (transformers', DeepSeek's): the f32 product is
    /// rounded once to the target, never to the scale's dtype first
    /// (`fp8::dequantize_once`).
    pub scale_inv: bool,
}

impl Deq {
    /// Bytes per output element.
    pub fn out_size(&self) -> u64 {
        (self.target.bitsize() / 8) as u64
    }

    /// The input tensors dequantizing it reads beside the weight: its scale, its zero point,
    /// an NVFP4 weight's global scale.
    pub fn companions(&self) -> impl Iterator<Item = usize> {
        let global = match self.packing {
            Packing::Nvfp4 { global, .. } => Some(global),
            _ => None,
        };
        std::iter::once(self.scale)
            .chain(self.zero_point.map(|z| z.tensor))
            .chain(global)
    }

    /// Source bytes of one granule, the unit a window holds whole: a row of the weight, or
    /// for gpt-oss one group of 32 columns of all an expert's rows (its windows run over
    /// the blocks in `[experts, cols / 32, rows, 16]` order, the output's).
    pub fn src_row(&self) -> u64 {
        match self.packing {
            Packing::Fp8 | Packing::I8 => self.cols,
            Packing::Nvfp4 { .. } | Packing::Mxfp4 => self.cols / 2,
            Packing::Int { bits } => (self.cols * u64::from(bits)).div_ceil(32) * 4,
            Packing::GptOss { .. } => self.rows * 16,
        }
    }

    /// Output bytes of one granule (`src_row`).
    pub fn out_row(&self) -> u64 {
        match self.packing {
            Packing::GptOss { .. } => 32 * self.rows * self.out_size(),
            _ => self.cols * self.out_size(),
        }
    }

    /// Output bytes for `len` source bytes (whole granules).
    pub fn out_len(&self, len: u64) -> u64 {
        len / self.src_row().max(1) * self.out_row()
    }

    /// The output's name for the weight's `name`: `X.weight_packed` -> `X.weight`,
    /// `X_blocks` -> `X`; an FP8 weight keeps its name.
    pub fn out_name<'a>(&self, name: &'a str) -> &'a str {
        let suffix = match self.packing {
            Packing::Fp8 | Packing::I8 => return name,
            Packing::GptOss { .. } => BLOCKS_SUFFIX,
            _ => PACKED_SUFFIX,
        };
        name.strip_suffix(suffix).unwrap_or(name)
    }

    /// The output's shape (`shape`: the weight's in the input).
    pub fn out_shape(&self, shape: &[usize]) -> Vec<usize> {
        match self.packing {
            Packing::Fp8 | Packing::I8 => shape.to_vec(),
            Packing::GptOss { experts } => {
                vec![experts as usize, self.cols as usize, self.rows as usize]
            }
            _ => vec![self.rows as usize, self.cols as usize],
        }
    }
}

/// The names a quantized checkpoint gives a weight's scale: compressed-tensors'
/// `weight_scale`, DeepSeek's `weight_scale_inv` (both multiply).
pub const SCALE_SUFFIXES: [&str; 2] = ["_scale", "_scale_inv"];

/// The name compressed-tensors gives a weight's zero point (asymmetric schemes).
pub const ZERO_POINT_SUFFIX: &str = "_zero_point";

/// What tensor `name` is to the quantized weight it ends as a companion of (`X.weight_scale`:
/// a scale, `X.weight_shape`: a packed weight's shape, ...), in words, or None: its
/// `companion_roles` entry.
pub fn companion_role(name: &str) -> Option<&'static str> {
    companion_roles().into_iter().find_map(|(suffix, role)| {
        let module = name.strip_suffix(&suffix[1..])?;
        (module.is_empty() || module.strip_suffix('.').is_some_and(|m| !m.is_empty()))
            .then_some(role)
    })
}

/// Each suffix of `companion_suffixes` that follows a module's weight (`.weight_scale`, ...),
/// and what such a tensor is to its weight, in words.
pub fn companion_roles() -> Vec<(String, &'static str)> {
    let shape = &crate::header::WEIGHT_SHAPE_SUFFIX[".weight".len()..];
    companion_suffixes()
        .into_iter()
        .filter_map(|s| {
            let after = s.strip_prefix(".weight")?;
            let role = if after == ZERO_POINT_SUFFIX {
                "zero point"
            } else if after == GLOBAL_SCALE_SUFFIX {
                "global scale"
            } else if after == shape {
                "shape"
            } else {
                "scale"
            };
            Some((s, role))
        })
        .collect()
}

/// The dtypes of a zero point stcast dequantizes with: compressed-tensors' `zp_dtype` for
/// FP8 (E4M3) and for integer schemes (int8, int16, int32); each converts to the scale's
/// dtype as torch's `.to()` does (`fp8::dequantize`).
pub const ZERO_POINT_DTYPES: [Dtype; 4] = [Dtype::F8_E4M3, Dtype::I8, Dtype::I16, Dtype::I32];

/// Per input tensor: its weight's `Deq` (an FP8 weight dequantized), and whether it is
/// dropped (a scale, zero point or activation scale of one).
pub type Pairing = (Vec<Option<Deq>>, Vec<bool>);

/// The FP8 weights of an input that can be dequantized to `target` (BF16 or F16): an
/// F8_E4M3 2-D `X.weight` with `X.weight_scale` or `X.weight_scale_inv` in F32, BF16 or F16,
/// shaped per tensor, channel, group or 128x128 block (or E8M0 exponents: compressed-tensors'
/// MXFP8 `weight_scale` in U8, one per 32 columns; transformers' `weight_scale_inv` in
/// F8_E8M0 or U8, on a grid transformers divides evenly), and beside a `weight_scale` perhaps
/// `X.weight_zero_point` (see `ZERO_POINT_DTYPES`) shaped as the scale. Returns, per input
/// tensor, the weight's `Deq`; and which input tensors are its scales and zero points, or
/// activation scales (`X.input_scale`, `input_scale_names`) that mean nothing once
/// dequantized: dropped.
///
/// A scale or zero point beside such a weight that stcast cannot use as compressed-tensors
/// (or DeepSeek) would is an error naming it: `(tensor, problem)`, never a silent copy.
///
/// Packed weights too (`Packing`): compressed-tensors `X.weight_packed` (U8 NVFP4 or MXFP4
/// by their scale's dtype, I32 INT codes of `X.weight_shape`'s width, whose value `shapes`
/// holds), an I8 `X.weight` with its scale, and gpt-oss `X_blocks` with `X_scales`; their
/// scales, global scales, zero points and shapes are dropped.
pub fn dequantizable(
    tensors: &[crate::header::SourceTensor],
    shapes: &[(String, [i64; 2])],
    target: Dtype,
) -> Result<Pairing, (String, Fp8Problem)> {
    use std::collections::HashMap;
    let by_name: HashMap<&str, usize> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut deq = vec![None; tensors.len()];
    let mut dropped = vec![false; tensors.len()];
    for (i, t) in tensors.iter().enumerate() {
        if let Some(found) = packed(tensors, &by_name, shapes, i, target)? {
            let (d, drop) = found;
            deq[i] = Some(d);
            for k in drop {
                dropped[k] = true;
            }
            continue;
        }
        if t.dtype != Dtype::F8_E4M3 || t.shape.len() != 2 || t.gather.is_some() {
            continue;
        }
        let Some(module) = module_of(&t.name) else {
            continue;
        };
        let (rows, cols) = (t.shape[0] as u64, t.shape[1] as u64);
        let named = |suffix: &str| {
            let name = format!("{}{suffix}", t.name);
            by_name.get(name.as_str()).map(|&k| (k, name))
        };
        // A companion must be one little-endian run of the weight's own file: the kernel
        // reads it in place.
        let beside = |k: usize, name: &str, zero_point: bool| {
            let c = &tensors[k];
            if c.gather.is_some() || c.input != t.input {
                return Err((
                    name.to_string(),
                    Fp8Problem::NotBeside {
                        weight: t.name.clone(),
                        zero_point,
                    },
                ));
            }
            Ok(())
        };
        let (k, scale_name, inv) = match (named(SCALE_SUFFIXES[0]), named(SCALE_SUFFIXES[1])) {
            (None, None) => continue,
            (Some((_, scale)), Some((_, scale_inv))) => {
                return Err((t.name.clone(), Fp8Problem::TwoScales { scale, scale_inv }));
            }
            (Some((k, n)), None) => (k, n, false),
            (None, Some((k, n))) => (k, n, true),
        };
        beside(k, &scale_name, false)?;
        let s = &tensors[k];
        // E8M0 exponents: compressed-tensors' MXFP8 (`weight_scale` in U8, a scale per 32
        // columns), transformers' FP8 (`weight_scale_inv` in F8_E8M0 or U8, any grid).
        let e8m0 = match (s.dtype, inv) {
            (Dtype::U8, _) | (Dtype::F8_E8M0, true) => true,
            (Dtype::F32 | Dtype::BF16 | Dtype::F16, _) => false,
            _ => {
                return Err((
                    scale_name,
                    Fp8Problem::Dtype {
                        weight: t.name.clone(),
                        zero_point: false,
                        dtype: s.dtype.to_string(),
                    },
                ))
            }
        };
        let layout = if e8m0 && !inv {
            // MXFP8: `[O, I / 32]`, whatever else that shape might read as; symmetric.
            let group = crate::packed::MXFP4_GROUP as u64;
            let mx = |detail: String| {
                let format = "mxfp8-quantized";
                Fp8Problem::Packed { format, detail }
            };
            if !cols.is_multiple_of(group) || s.shape != [rows as usize, (cols / group) as usize] {
                let detail = format!(
                    "a scale in U8 (E8M0 exponents) of shape {:?} beside `{}` {:?}: MXFP8's is \
                     [O, I/32], one per 32 columns of a row",
                    s.shape, t.name, t.shape
                );
                return Err((scale_name, mx(detail)));
            }
            if let Some((_, zp_name)) = named(ZERO_POINT_SUFFIX) {
                let detail = "a zero point beside E8M0 scales (MXFP8 is symmetric)".into();
                return Err((zp_name, mx(detail)));
            }
            Layout::Group(group)
        } else {
            if ambiguous(&s.shape, rows, cols) {
                return Err((
                    scale_name,
                    Fp8Problem::AmbiguousScale {
                        weight: t.name.clone(),
                        shape: s.shape.clone(),
                        expected: t.shape.clone(),
                    },
                ));
            }
            let Some(layout) = layout_of(&s.shape, rows, cols) else {
                return Err((
                    scale_name,
                    Fp8Problem::Shape {
                        weight: t.name.clone(),
                        zero_point: false,
                        shape: s.shape.clone(),
                        expected: t.shape.clone(),
                    },
                ));
            };
            // transformers reads an E8M0 grid as blocks of rows / R x cols / C: a ceil-divided
            // 128x128 grid only where that is 128 (or the whole dimension).
            let even = |n: u64| n <= BLOCK || n.is_multiple_of(BLOCK);
            if e8m0 && layout == Layout::Block && !(even(rows) && even(cols)) {
                return Err((
                    scale_name,
                    Fp8Problem::Packed {
                        format: "FP8 (E8M0 scales)",
                        detail: format!(
                            "a 128x128-block grid {:?} of `{}` {:?}, which transformers' FP8 \
                             dequantization reads as blocks of another size",
                            s.shape, t.name, t.shape
                        ),
                    },
                ));
            }
            layout
        };
        let zero_point = match named(ZERO_POINT_SUFFIX) {
            None => None,
            Some((_, zp_name)) if inv => {
                return Err((
                    zp_name,
                    Fp8Problem::ZeroPointWithScaleInv {
                        weight: t.name.clone(),
                        scale_inv: scale_name,
                    },
                ));
            }
            Some((z, zp_name)) => {
                beside(z, &zp_name, true)?;
                let zp = &tensors[z];
                if !ZERO_POINT_DTYPES.contains(&zp.dtype) {
                    return Err((
                        zp_name,
                        Fp8Problem::Dtype {
                            weight: t.name.clone(),
                            zero_point: true,
                            dtype: zp.dtype.to_string(),
                        },
                    ));
                }
                // Shaped as the scale (one element, whatever its rank, for one scale), as
                // compressed-tensors makes it: then element i of both is one group's.
                let same = zp.shape == s.shape || (layout == Layout::Tensor && is_one(&zp.shape));
                if !same {
                    return Err((
                        zp_name,
                        Fp8Problem::Shape {
                            weight: t.name.clone(),
                            zero_point: true,
                            shape: zp.shape.clone(),
                            expected: s.shape.clone(),
                        },
                    ));
                }
                dropped[z] = true;
                Some(ZeroPoint {
                    tensor: z,
                    dtype: zp.dtype,
                })
            }
        };
        deq[i] = Some(Deq {
            scale: k,
            s_dtype: s.dtype,
            zero_point,
            layout,
            rows,
            cols,
            target,
            packing: Packing::Fp8,
            scale_inv: inv,
        });
        dropped[k] = true;
        for n in input_scale_names(module) {
            if let Some(&k) = by_name.get(n.as_str()) {
                dropped[k] = true;
            }
        }
    }
    // A packed weight comes out under its weight's name (`X.weight_packed` as `X.weight`):
    // a tensor the output keeps under that name, or another pack renamed the same, would
    // be a second tensor of one name in one file.
    let mut renamed: HashMap<&str, usize> = HashMap::new();
    for (i, d) in deq.iter().enumerate() {
        let Some(d) = d else { continue };
        let name = tensors[i].name.as_str();
        let out = d.out_name(name);
        if out == name {
            continue;
        }
        let kept = by_name.get(out).copied().filter(|&k| !dropped[k]);
        if let Some(other) = kept.or_else(|| renamed.insert(out, i)) {
            let other = tensors[other].name.clone();
            return Err((
                name.to_string(),
                Fp8Problem::NameTaken {
                    out: out.to_string(),
                    other,
                },
            ));
        }
    }
    Ok((deq, dropped))
}

/// The refusal of packed tensor `tensor` of `format`: `detail` says what does not fit.
/// A `weight_shape`'s value as a message shows it: `[r, c]`, or what it is not.
fn shown(v: Option<[i64; 2]>) -> String {
    match v {
        Some([r, c]) => format!("[{r}, {c}]"),
        None => "no [rows, columns] of integers".into(),
    }
}

fn fail<T>(tensor: &str, format: &'static str, detail: String) -> Result<T, (String, Fp8Problem)> {
    Err((tensor.to_string(), Fp8Problem::Packed { format, detail }))
}

/// A packed weight's pairing (`dequantizable`): tensor `i`'s `Deq` and the tensors its
/// dequantization drops, None when `i` is no packed weight, or the problem naming the
/// tensor that does not fit.
#[allow(clippy::type_complexity)]
fn packed(
    tensors: &[crate::header::SourceTensor],
    by_name: &std::collections::HashMap<&str, usize>,
    shapes: &[(String, [i64; 2])],
    i: usize,
    target: Dtype,
) -> Result<Option<(Deq, Vec<usize>)>, (String, Fp8Problem)> {
    let t = &tensors[i];
    let named = |name: String| by_name.get(name.as_str()).map(|&k| (k, name));
    // Companions are read whole, in place: one little-endian run of the weight's file.
    let beside = |k: usize, format: &'static str| -> Result<(), (String, Fp8Problem)> {
        let c = &tensors[k];
        if c.gather.is_some() || c.input != t.input || t.gather.is_some() {
            return fail(
                &c.name,
                format,
                format!("not stored whole beside `{}` in its file", t.name),
            );
        }
        Ok(())
    };
    let e8m0 = |d: Dtype| matches!(d, Dtype::U8 | Dtype::F8_E8M0);
    // gpt-oss MXFP4: `X_blocks` [E, R, G, 16] U8 with `X_scales` [E, R, G].
    if let Some(stem) = t.name.strip_suffix(BLOCKS_SUFFIX) {
        const F: &str = "gpt-oss MXFP4";
        let Some((k, scale_name)) = named(format!("{stem}{SCALES_SUFFIX}")) else {
            return Ok(None);
        };
        let s = &tensors[k];
        let ok = t.dtype == Dtype::U8
            && t.shape.len() == 4
            && t.shape[3] == 16
            && e8m0(s.dtype)
            && s.shape[..] == t.shape[..3];
        if !ok {
            return fail(
                &t.name,
                F,
                format!(
                    "blocks {} {:?} with scales `{scale_name}` {} {:?}; stcast reads U8 \
                     [experts, rows, groups, 16] with U8 [experts, rows, groups]",
                    t.dtype, t.shape, s.dtype, s.shape
                ),
            );
        }
        beside(k, F)?;
        let d = Deq {
            scale: k,
            s_dtype: s.dtype,
            zero_point: None,
            layout: Layout::Group(32),
            rows: t.shape[1] as u64,
            cols: t.shape[2] as u64 * 32,
            target,
            packing: Packing::GptOss {
                experts: t.shape[0] as u64,
            },
            scale_inv: false,
        };
        return Ok(Some((d, vec![k])));
    }
    // compressed-tensors: `X.weight_packed` (FP4 in U8, INT in I32), or an I8 `X.weight`.
    let (weight, packed) = match t.name.strip_suffix(PACKED_SUFFIX) {
        Some(w) if module_of(w).is_some() => (w, true),
        _ if t.dtype == Dtype::I8 && module_of(&t.name).is_some() => (t.name.as_str(), false),
        _ => return Ok(None),
    };
    let format: &'static str = match (packed, t.dtype) {
        (false, _) => "int-quantized",
        (true, Dtype::U8) => "FP4 pack-quantized",
        (true, Dtype::I32) => "pack-quantized",
        (true, _) => {
            return fail(
                &t.name,
                "pack-quantized",
                format!(
                    "packed weight in {}; stcast reads U8 (FP4) or I32 (INT)",
                    t.dtype
                ),
            )
        }
    };
    let Some((k, scale_name)) = named(format!("{weight}{}", SCALE_SUFFIXES[0])) else {
        if !packed {
            return Ok(None); // an I8 weight of a model, not a quantized one
        }
        return fail(&t.name, format, "no `weight_scale` beside it".to_string());
    };
    if t.shape.len() != 2 {
        return fail(&t.name, format, format!("shape {:?}, not 2-D", t.shape));
    }
    beside(k, format)?;
    let s = &tensors[k];
    let rows = t.shape[0] as u64;
    let mut drop = vec![k];
    let shape_name = match module_of(weight) {
        Some(m) if !m.is_empty() => format!("{m}{}", crate::header::WEIGHT_SHAPE_SUFFIX),
        _ => crate::header::WEIGHT_SHAPE_SUFFIX[1..].to_string(),
    };
    let shape = named(shape_name).map(|(k, n)| {
        drop.push(k);
        let v = shapes.iter().find(|(m, _)| *m == n).map(|&(_, v)| v);
        (n, v)
    });
    for n in input_scale_names(module_of(weight).unwrap_or("")) {
        if let Some(&k) = by_name.get(n.as_str()) {
            drop.push(k);
        }
    }
    let zp = named(format!("{weight}{ZERO_POINT_SUFFIX}"));
    let width = |cols: u64| -> Result<(), (String, Fp8Problem)> {
        match &shape {
            None => Ok(()),
            Some((_, Some([r, c])))
                if *r as u64 == rows && *c as u64 == cols && *r >= 0 && *c >= 0 =>
            {
                Ok(())
            }
            Some((n, v)) => fail(
                n,
                format,
                format!(
                    "holds {}, not the [{rows}, {cols}] its packed weight `{}` makes",
                    shown(*v),
                    t.name
                ),
            ),
        }
    };
    let (packing, cols, layout) = match t.dtype {
        Dtype::U8 => {
            let cols = t.shape[1] as u64 * 2;
            width(cols)?;
            let (packing, group, format) = match s.dtype {
                Dtype::F8_E4M3 => {
                    let Some((g, gname)) = named(format!("{weight}{GLOBAL_SCALE_SUFFIX}")) else {
                        return fail(
                            &t.name,
                            "nvfp4-pack-quantized",
                            "no `weight_global_scale` beside it".into(),
                        );
                    };
                    let gt = &tensors[g];
                    if gt.dtype != Dtype::F32
                        || gt.shape.iter().product::<usize>() != 1
                        || gt.shape.len() > 1
                    {
                        return fail(
                            &gname,
                            "nvfp4-pack-quantized",
                            format!("{} {:?}, not one F32", gt.dtype, gt.shape),
                        );
                    }
                    beside(g, "nvfp4-pack-quantized")?;
                    drop.push(g);
                    let scalar = gt.shape.is_empty();
                    (
                        Packing::Nvfp4 { global: g, scalar },
                        crate::packed::NVFP4_GROUP as u64,
                        "nvfp4-pack-quantized",
                    )
                }
                d if e8m0(d) => (
                    Packing::Mxfp4,
                    crate::packed::MXFP4_GROUP as u64,
                    "mxfp4-pack-quantized",
                ),
                d => {
                    return fail(
                        &scale_name,
                        format,
                        format!("scale in {d}; FP4 scales are F8_E4M3 (NVFP4) or U8 (MXFP4)"),
                    )
                }
            };
            if zp.is_some() {
                return fail(&t.name, format, "a zero point beside FP4 codes".into());
            }
            if cols == 0
                || !cols.is_multiple_of(group)
                || s.shape != [rows as usize, (cols / group) as usize]
            {
                return fail(
                    &scale_name,
                    format,
                    format!(
                        "shape {:?}, not [{rows}, {}] for groups of {group}",
                        s.shape,
                        cols / group.max(1)
                    ),
                );
            }
            (packing, cols, Layout::Group(group))
        }
        _ => {
            if !matches!(s.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
                return fail(
                    &scale_name,
                    format,
                    format!("scale in {}; stcast reads F32, BF16 or F16", s.dtype),
                );
            }
            let (packing, cols) = if packed {
                let Some((n, v)) = &shape else {
                    return fail(
                        &t.name,
                        format,
                        "no `weight_shape` beside it: its width and bit width are unknown".into(),
                    );
                };
                let Some([_, c]) = v.filter(|[r, c]| *r as u64 == rows && *c > 0) else {
                    return fail(
                        n,
                        format,
                        format!("holds {}, not [{rows}, columns]", shown(*v)),
                    );
                };
                let c = c as u64;
                let words = t.shape[1] as u64;
                // `c` is the file's value: a product past u64 fits no row of words.
                let bits: Vec<u32> = (1..=8u32)
                    .filter(|&b| {
                        c.checked_mul(u64::from(b))
                            .is_some_and(|n| n.div_ceil(32) == words)
                    })
                    .collect();
                let [bits] = bits[..] else {
                    return fail(
                        &t.name,
                        format,
                        format!("{words} words a row do not tell one bit width for {c} columns"),
                    );
                };
                (Packing::Int { bits }, c)
            } else {
                (Packing::I8, t.shape[1] as u64)
            };
            let dims: Vec<u64> = s.shape.iter().map(|&d| d as u64).collect();
            let layout = if is_one(&s.shape) {
                Layout::Tensor
            } else if dims == [rows, 1] {
                Layout::Channel
            } else if let [r, g] = dims[..] {
                if r == rows && g > 1 && cols.is_multiple_of(g) {
                    Layout::Group(cols / g)
                } else {
                    return fail(
                        &scale_name,
                        format,
                        format!(
                            "shape {:?} is no tensor, channel or group layout of [{rows}, {cols}]",
                            s.shape
                        ),
                    );
                }
            } else {
                return fail(
                    &scale_name,
                    format,
                    format!(
                        "shape {:?} is no tensor, channel or group layout of [{rows}, {cols}]",
                        s.shape
                    ),
                );
            };
            (packing, cols, layout)
        }
    };
    let zero_point = match zp {
        None => None,
        Some((z, zname)) => {
            beside(z, format)?;
            let zt = &tensors[z];
            let want: Vec<usize> = match packing {
                Packing::Int { bits } => {
                    let (r, g) = match s.shape[..] {
                        [r, g] => (r, g),
                        _ => (1, 1),
                    };
                    vec![(r as u64 * u64::from(bits)).div_ceil(32) as usize, g]
                }
                _ => s.shape.clone(),
            };
            let want_dtype = match packing {
                Packing::Int { .. } => Dtype::I32,
                _ => Dtype::I8,
            };
            if zt.dtype != want_dtype
                || zt.shape != want
                || matches!((packing, layout), (Packing::Int { .. }, Layout::Tensor))
            {
                return fail(
                    &zname,
                    format,
                    format!(
                        "zero point {} {:?}, not {want_dtype} {want:?}",
                        zt.dtype, zt.shape
                    ),
                );
            }
            drop.push(z);
            Some(ZeroPoint {
                tensor: z,
                dtype: zt.dtype,
            })
        }
    };
    let d = Deq {
        scale: k,
        s_dtype: s.dtype,
        zero_point,
        layout,
        rows,
        cols,
        target,
        packing,
        scale_inv: false,
    };
    Ok(Some((d, drop)))
}

/// One scheme of a compressed-tensors `quantization_config` (a `config_groups` entry's
/// `weights`, and its format, the group's or the config's): what it says of its packed
/// weights. A fact the config leaves out (or not as a number, string, bool) is not checked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scheme {
    pub format: Option<String>,
    /// `type`: `int` or `float`.
    pub kind: Option<String>,
    pub num_bits: Option<u64>,
    pub strategy: Option<String>,
    pub group_size: Option<u64>,
    pub symmetric: Option<bool>,
    /// `targets`: the modules the group quantizes (names, `re:` patterns, `Linear` for
    /// every module); none: every module, as compressed-tensors' dequantizer reads it.
    pub targets: Vec<String>,
}

/// What a folder's model config `config` says of the packed weights a run dequantizes: its
/// compressed-tensors schemes (none for another quant_method: nothing then to check).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schemes {
    pub config: std::path::PathBuf,
    pub groups: Vec<Scheme>,
    /// `ignore`: the modules no group quantizes (names and `re:` patterns).
    pub ignore: Vec<String>,
}

/// A `targets` or `ignore` entry of a compressed-tensors config, as its dequantizer matches
/// module names (`match_name`, `match_quantizable_tensors`): `re:P` when Python's
/// `re.match(P, name)` matches (at the start of the name), `Linear` every module, any other
/// entry the name it is (a class name other than `Linear` names no module there).
enum ModulePattern {
    Any,
    Name(String),
    Regex(regex::Regex),
}

/// What in a `re:` pattern the `regex` crate would read otherwise than Python's `re` does,
/// though both accept it (docs/rounding.md): nested classes, class set operations, POSIX
/// classes, Unicode property escapes (which Python refuses).
const NOT_PYTHON_RE: [&str; 6] = ["[[", "&&", "--", "~~", "\\p", "\\P"];

impl ModulePattern {
    /// Compile an entry; the error says why a `re:` pattern cannot be matched as Python does.
    fn new(entry: &str) -> Result<ModulePattern, String> {
        let Some(re) = entry.strip_prefix("re:") else {
            return Ok(match entry {
                "Linear" => ModulePattern::Any,
                _ => ModulePattern::Name(entry.to_string()),
            });
        };
        if let Some(bad) = NOT_PYTHON_RE.iter().find(|b| re.contains(*b)) {
            return Err(format!("`{bad}` reads otherwise in Python's re"));
        }
        // `re.match`: anchored at the start only.
        regex::Regex::new(&format!("^(?:{re})"))
            .map(ModulePattern::Regex)
            .map_err(|e| {
                let e = e.to_string();
                let last = e.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
                last.trim().trim_start_matches("error: ").to_string()
            })
    }

    fn matches(&self, module: &str) -> bool {
        match self {
            ModulePattern::Any => true,
            ModulePattern::Name(n) => n == module,
            ModulePattern::Regex(r) => r.is_match(module),
        }
    }
}

/// Does the `targets` or `ignore` entry `entry` name `module`, as compressed-tensors matches
/// it (`ModulePattern`)? A `re:` pattern stcast cannot match as Python does names none.
pub fn names_module(entry: &str, module: &str) -> bool {
    ModulePattern::new(entry).is_ok_and(|p| p.matches(module))
}

/// The entry `entry` with a `re:` pattern's `\\Z` (Python's end of the string, which the
/// `ignore` entries stcast writes end with: `run::json::ignore_entry`) spelled as the
/// regex crate spells it (`\\z`), for verify's check of an FP8 output's config.
pub fn python_end(entry: &str) -> std::borrow::Cow<'_, str> {
    if !(entry.starts_with("re:") && entry.contains("\\Z")) {
        return entry.into();
    }
    let mut out = String::with_capacity(entry.len());
    let mut chars = entry.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Z') => out.push_str("\\z"),
            Some(next) => out.extend([c, next]),
            None => out.push(c),
        }
    }
    out.into()
}

/// Why stcast cannot match the `targets` or `ignore` entry `entry` as compressed-tensors
/// does (`ModulePattern`: a `re:` pattern that is no regex, or that Python's `re` reads
/// otherwise); None when it can.
pub fn pattern_problem(entry: &str) -> Option<String> {
    ModulePattern::new(entry).err()
}

impl Schemes {
    /// Does the config describe every packed weight of `deq` (`dequantizable`'s, of
    /// `tensors`) as its tensors store it? Each weight's module is matched as
    /// compressed-tensors' dequantizer matches it (`ModulePattern`): not named by `ignore`,
    /// and taken by the first group (in the config's order) whose `targets` name it and
    /// whose format stores its codes as they are (packed or not); that group must say its
    /// format, type and bits, its grouping, its zero points (asymmetric) or none
    /// (symmetric). The error names the weight, what the config says and what its tensors
    /// hold, or a `re:` pattern stcast cannot match as Python's `re` does.
    pub fn check(
        &self,
        tensors: &[crate::header::SourceTensor],
        deq: &[Option<Deq>],
    ) -> Result<(), (String, Fp8Problem)> {
        let packed: Vec<(&crate::header::SourceTensor, Deq)> = tensors
            .iter()
            .zip(deq)
            .filter_map(|(t, d)| Some((t, (*d)?)))
            .filter(|(_, d)| !matches!(d.packing, Packing::GptOss { .. }))
            .collect();
        let Some(first) = packed.first().filter(|_| !self.groups.is_empty()) else {
            return Ok(());
        };
        let compile = |list: &[String]| -> Result<Vec<ModulePattern>, (String, Fp8Problem)> {
            list.iter()
                .map(|p| {
                    ModulePattern::new(p).map_err(|reason| {
                        let problem = Fp8Problem::Pattern {
                            config: self.config.clone(),
                            pattern: p.clone(),
                            reason,
                        };
                        (first.0.name.clone(), problem)
                    })
                })
                .collect()
        };
        let ignore = compile(&self.ignore)?;
        let targets = self
            .groups
            .iter()
            .map(|g| compile(&g.targets))
            .collect::<Result<Vec<_>, _>>()?;
        for (t, d) in packed {
            let module = module_of(d.out_name(&t.name)).unwrap_or("");
            let fail = |says: String, holds: String| {
                let problem = Fp8Problem::Config {
                    format: packed_format(d.packing),
                    config: self.config.clone(),
                    says,
                    holds,
                };
                Err((t.name.clone(), problem))
            };
            let codes = format!("{} codes", packed_format(d.packing));
            if d.packing == Packing::Fp8 {
                // An FP8 weight: its group's symmetry against its zero point, which
                // compressed-tensors reads only for an asymmetric scheme (a symmetric one
                // would leave it unread: other bits than stcast's). An asymmetric group over
                // a weight without one is refused too: compressed-tensors 0.19's dequantizer
                // (`CompressedTensorsDequantizer.process`) takes every parameter its
                // compressor names for the scheme, `weight_zero_point` among them, and
                // fails (KeyError) where one is missing; its loader would instead start
                // from a zero point of zeros it never reads. No reference bits to match.
                let group = self.groups.iter().zip(&targets).find(|(g, ts)| {
                    let stores = g
                        .format
                        .as_deref()
                        .is_none_or(|f| !f.ends_with("pack-quantized"));
                    stores && (ts.is_empty() || ts.iter().any(|p| p.matches(module)))
                });
                let ignored = ignore.iter().any(|p| p.matches(module));
                if let (Some((g, _)), false) = (group, ignored) {
                    if let Some((says, holds)) = symmetry_mismatch(g, d) {
                        return fail(says, holds);
                    }
                }
                continue;
            }
            if let Some(k) = ignore.iter().position(|p| p.matches(module)) {
                let says = format!(
                    "`ignore` entry `{}` names module `{module}`",
                    self.ignore[k]
                );
                return fail(says, codes);
            }
            let is_packed = t.name.ends_with(PACKED_SUFFIX);
            let group = self.groups.iter().zip(&targets).find(|(g, ts)| {
                let stores = g
                    .format
                    .as_deref()
                    .is_none_or(|f| f.ends_with("pack-quantized") == is_packed);
                stores && (ts.is_empty() || ts.iter().any(|p| p.matches(module)))
            });
            let Some((g, _)) = group else {
                let says = format!("no config group's `targets` names module `{module}`");
                return fail(says, codes);
            };
            if let Some((says, holds)) = scheme_mismatch(g, d) {
                return fail(says, holds);
            }
        }
        Ok(())
    }
}

/// The compressed-tensors formats that store codes as `packing` does, the codes' type and
/// bits.
fn scheme_of(packing: Packing) -> (&'static [&'static str], &'static str, u64) {
    match packing {
        Packing::Fp8 => (
            &["float-quantized", "naive-quantized", "mxfp8-quantized"],
            "float",
            8,
        ),
        Packing::Nvfp4 { .. } => (&["nvfp4-pack-quantized"], "float", 4),
        Packing::Mxfp4 => (&["mxfp4-pack-quantized"], "float", 4),
        Packing::Int { bits } => (&["pack-quantized"], "int", u64::from(bits)),
        _ => (&["int-quantized", "naive-quantized"], "int", 8),
    }
}

/// The format a packed weight's codes are in, as compressed-tensors names it.
fn packed_format(packing: Packing) -> &'static str {
    scheme_of(packing).0[0]
}

/// What scheme `g` says that packed weight `d` does not hold: (the config's words, the
/// tensors'), or None when they agree.
fn scheme_mismatch(g: &Scheme, d: Deq) -> Option<(String, String)> {
    let (formats, kind, bits) = scheme_of(d.packing);
    if let Some(f) = g.format.as_deref().filter(|f| !formats.contains(f)) {
        return Some((format!("format {f}"), format!("{} codes", formats[0])));
    }
    if let Some(k) = g.kind.as_deref().filter(|&k| k != kind) {
        return Some((format!("type {k}"), format!("{kind} codes")));
    }
    if let Some(b) = g.num_bits.filter(|&b| b != bits) {
        return Some((format!("num_bits {b}"), format!("{bits}-bit codes")));
    }
    // Rows and columns one scale covers: the tensors', the config's.
    let (rows, cols) = (d.rows, d.cols);
    let span = |(r, c): (u64, u64)| (r.min(rows), c.min(cols));
    let held = span(match d.layout {
        Layout::Tensor => (rows, cols),
        Layout::Channel => (1, cols),
        Layout::Group(g) => (1, g),
        Layout::Block => (BLOCK, BLOCK),
    });
    let show = |(r, c): (u64, u64)| match (r, c) {
        (1, c) if c == cols => "a scale per row".to_string(),
        (1, c) => format!("a scale per {c} columns of a row"),
        _ => "one scale for the tensor".to_string(),
    };
    if let Some(strategy) = g.strategy.as_deref() {
        let said = match (strategy, g.group_size) {
            ("tensor", _) => Some((rows, cols)),
            ("channel", _) => Some((1, cols)),
            ("group" | "tensor_group", Some(size)) if size > 0 => Some((1, size)),
            ("group" | "tensor_group", _) => None,
            _ => Some((0, 0)),
        };
        if said.map(span).is_some_and(|s| s != held) {
            let size = match g.group_size {
                Some(s) if strategy.contains("group") => format!(", group_size {s}"),
                _ => String::new(),
            };
            return Some((format!("strategy {strategy}{size}"), show(held)));
        }
    }
    symmetry_mismatch(g, d)
}

/// What scheme `g` says of zero points that weight `d` does not hold: a symmetric scheme
/// has none, an asymmetric one has one.
fn symmetry_mismatch(g: &Scheme, d: Deq) -> Option<(String, String)> {
    match (g.symmetric, d.zero_point.is_some()) {
        (Some(true), true) => Some(("symmetric true".into(), "a zero point".into())),
        (Some(false), false) => Some(("symmetric false".into(), "no zero point".into())),
        _ => None,
    }
}

/// Does a scale of shape `shape` for a `rows x cols` weight fit two layouts that group its
/// elements differently? Only a one-row weight's `[1, G]` can: 128-column blocks, or groups
/// of cols/G columns. The two agree when cols/G is 128 (or G is 1, a per-tensor scale); a
/// file does not say which it is, so any other such scale is ambiguous.
fn ambiguous(shape: &[usize], rows: u64, cols: u64) -> bool {
    let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    match dims[..] {
        [1, g] => {
            rows == 1
                && g > 1
                && g == cols.div_ceil(BLOCK)
                && cols.is_multiple_of(g)
                && cols / g != BLOCK
        }
        _ => false,
    }
}

/// The layout of a scale of shape `shape` for a `rows x cols` weight, or None. A shape two
/// layouts give is read as the first of tensor, channel, block, group; where two give it,
/// they group the elements alike (`ambiguous` refuses the one-row shapes where they do
/// not, before this).
fn layout_of(shape: &[usize], rows: u64, cols: u64) -> Option<Layout> {
    let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    if is_one(shape) {
        Some(Layout::Tensor)
    } else if dims == [rows, 1] {
        Some(Layout::Channel)
    } else if dims == [rows.div_ceil(BLOCK), cols.div_ceil(BLOCK)] {
        Some(Layout::Block)
    } else if let [r, g] = dims[..] {
        (r == rows && g > 1 && cols.is_multiple_of(g)).then(|| Layout::Group(cols / g))
    } else {
        None
    }
}

/// Is a tensor of this shape one value (of rank 0, 1 or 2)?
fn is_one(shape: &[usize]) -> bool {
    shape.len() <= 2 && shape.iter().product::<usize>() == 1
}

/// The names of module `module`'s activation quantization parameters (static activations:
/// FP8's `input_scale`, NVFP4 W4A4's `input_global_scale`, an asymmetric scheme's
/// `input_zero_point`): they mean nothing once its weight is dequantized.
pub fn input_scale_names(module: &str) -> [String; 3] {
    ["input_scale", "input_global_scale", "input_zero_point"].map(|n| {
        if module.is_empty() {
            n.to_string()
        } else {
            format!("{module}.{n}")
        }
    })
}

/// The scale tensor's name for weight `name`.
pub fn scale_name(name: &str) -> String {
    format!("{name}{}", SCALE_SUFFIXES[0])
}

/// What follows a module's name in the tensors beside its FP8 weight that a dequantization
/// drops: its scales and zero point (`.weight_scale`, ...), its activation scale.
pub fn companion_suffixes() -> Vec<String> {
    // A packed weight's too: its NVFP4 global scale, its `weight_shape`.
    let shape = &crate::header::WEIGHT_SHAPE_SUFFIX[".weight".len()..];
    let weight = SCALE_SUFFIXES
        .iter()
        .chain([&ZERO_POINT_SUFFIX, &GLOBAL_SCALE_SUFFIX, &shape]);
    let mut out: Vec<String> = weight.map(|s| format!(".weight{s}")).collect();
    out.extend(input_scale_names("").map(|n| format!(".{n}")));
    out
}

/// The module a weight belongs to (`a.b.weight` -> `a.b`); None when the last name part is
/// not `weight`.
pub fn module_of(name: &str) -> Option<&str> {
    if name == "weight" {
        Some("")
    } else {
        name.strip_suffix(".weight")
    }
}

/// The module an FP8 output's `ignore` must name for a weight `name` of `shape` that is not
/// quantized: that of every 2-D `*.weight`, whatever its dtype (an I8 or F64 matrix is no
/// more FP8 than a BF16 one). None for other tensors, and for a bare root `weight` (an
/// empty pattern would name every module).
pub fn unquantized_module<'a>(name: &'a str, shape: &[usize]) -> Option<&'a str> {
    let module = module_of(name).filter(|m| !m.is_empty())?;
    (shape.len() == 2).then_some(module)
}

/// The modules of a vision-language model's vision side, by a dotted part of their name:
/// the vision tower (`vision_tower`: LLaVA, Gemma 3, Mistral 3; `visual`: Qwen2-VL to
/// Qwen3-VL; `vision_model`: Mllama, Idefics3; `vision_encoder`) and its projector into the
/// language model (`multi_modal_projector`, `mm_projector`; Phi-3-vision's
/// `vision_embed_tokens`). llm-compressor's FP8 recipes for these models ignore them
/// (`re:vision_tower.*`, `re:multi_modal_projector.*`, `re:visual.*`, `re:vision_model.*`),
/// and the FP8 checkpoints vLLM serves leave them unquantized: so does an FP8 target.
pub const VISION_MODULES: [&str; 7] = [
    "vision_tower",
    "visual",
    "vision_model",
    "vision_encoder",
    "multi_modal_projector",
    "mm_projector",
    "vision_embed_tokens",
];

/// Quantize a tensor under `strategy`, or why not.
pub fn choose(
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    strategy: Strategy,
) -> Result<Quant, Fp8Skip> {
    // Fused MoE experts (`mlp.experts.gate_up_proj`, with or without `.weight`) are 3-D.
    if shape.len() == 3 && name.to_ascii_lowercase().contains("expert") {
        return Err(Fp8Skip::Experts);
    }
    let module = module_of(name).ok_or(Fp8Skip::NotWeight)?;
    let lower = module.to_ascii_lowercase();
    let last = lower.rsplit('.').next().unwrap_or("");
    let parent = lower.rsplit_once('.').map_or("", |(p, _)| p);
    if lower.ends_with("norm") {
        return Err(Fp8Skip::Norm);
    }
    if last == "lm_head" {
        return Err(Fp8Skip::LmHead);
    }
    if lower
        .split('.')
        .any(|p| p == "embed_tokens" || p == "wte" || p == "wpe" || p.contains("embeddings"))
    {
        return Err(Fp8Skip::Embedding);
    }
    // Qwen2-MoE's `shared_expert_gate` ([1, hidden]) is a gate too.
    let gate = last == "gate" && (parent.ends_with("mlp") || parent.ends_with("moe"));
    if last == "router" || last == "shared_expert_gate" || gate {
        return Err(Fp8Skip::Router);
    }
    if shape.len() != 2 {
        return Err(Fp8Skip::NotMatrix);
    }
    if !matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
        return Err(Fp8Skip::Dtype);
    }
    if shape[0] == 0 || shape[1] == 0 {
        return Err(Fp8Skip::Empty);
    }
    // Last: only weights that would be quantized are told apart as the vision side's.
    if lower.split('.').any(|p| VISION_MODULES.contains(&p)) {
        return Err(Fp8Skip::Vision);
    }
    Ok(Quant {
        d: dtype,
        strategy,
        rows: shape[0] as u64,
        cols: shape[1] as u64,
    })
}

/// Fused layers vLLM loads as one (q/k/v, gate/up): under blocks every part but the last
/// needs an output dim that is a multiple of 128. Returns the modules where one does not,
/// from `(name, rows)` of the quantized weights.
pub fn misfit_fused_parts<'a>(weights: impl Iterator<Item = (&'a str, u64)>) -> Vec<String> {
    const LEADING: [&str; 3] = ["q_proj", "k_proj", "gate_proj"];
    let mut out: Vec<String> = weights
        .filter_map(|(name, rows)| {
            let module = module_of(name)?;
            let last = module.rsplit('.').next()?;
            (LEADING.contains(&last) && !rows.is_multiple_of(BLOCK)).then(|| module.to_string())
        })
        .collect();
    out.sort();
    out
}

/// What a dequantized weight's codes are and what they become, as `inspect` names them
/// (`Deq::format`): the checkpoint's own format name, the codes, the scale and how it is
/// grouped, the zero point if any, and all that in words.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Format {
    /// The format as the checkpoint names it: compressed-tensors' `nvfp4-pack-quantized`,
    /// `mxfp4-pack-quantized`, `pack-quantized`, `int-quantized` or `float-quantized`, or
    /// gpt-oss's `mxfp4`.
    pub format: &'static str,
    /// The codes: `E2M1`, `INT4`, `INT8` (any bit width `INTn`), `E4M3`.
    pub codes: String,
    /// The scale's dtype: `E8M0` for MX scales (stored as U8 or F8_E8M0), else the dtype.
    pub scale_dtype: String,
    /// `tensor`, `channel`, `group` or `block` (128x128).
    pub strategy: &'static str,
    /// Codes per scale along a row, for `group`.
    pub group_size: Option<u64>,
    /// Whether codes are scaled as they are (no zero point).
    pub symmetric: bool,
    /// In words: `NVFP4 (E2M1 ×E4M3 per 16 ×F32) → BF16`.
    pub text: String,
}

/// A scale dtype as formats name it: the MX scales' E8M0 (U8 or F8_E8M0 on disk), E4M3, or
/// the dtype's own name.
fn scale_dtype_name(d: Dtype) -> String {
    match d {
        Dtype::U8 | Dtype::F8_E8M0 => "E8M0".into(),
        Dtype::F8_E4M3 => "E4M3".into(),
        d => d.to_string(),
    }
}

impl Deq {
    /// The format of its codes and what they become (`Format`).
    pub fn format(&self) -> Format {
        let scale = scale_dtype_name(self.s_dtype);
        let (strategy, group_size, per) = match self.layout {
            Layout::Tensor => ("tensor", None, "per tensor".to_string()),
            Layout::Channel => ("channel", None, "per channel".to_string()),
            Layout::Block => ("block", None, format!("per {BLOCK}×{BLOCK} block")),
            Layout::Group(g) => ("group", Some(g), format!("per {g}")),
        };
        let symmetric = self.zero_point.is_none();
        // `(q − zp)` where a zero point shifts the codes before they are scaled.
        let shifted = |codes: &str| match symmetric {
            true => codes.to_string(),
            false => "(q − zp)".to_string(),
        };
        let (format, codes, text) = match self.packing {
            Packing::Nvfp4 { .. } => (
                "nvfp4-pack-quantized",
                "E2M1".to_string(),
                format!("NVFP4 (E2M1 ×{scale} {per} ×F32)"),
            ),
            Packing::Mxfp4 => (
                "mxfp4-pack-quantized",
                "E2M1".to_string(),
                format!("MXFP4 (E2M1 ×{scale} {per})"),
            ),
            Packing::GptOss { experts } => (
                "mxfp4",
                "E2M1".to_string(),
                format!("gpt-oss MXFP4 (E2M1 ×{scale} {per}, {experts} experts)"),
            ),
            Packing::Int { bits } => {
                let codes = format!("INT{bits}");
                let sym = if symmetric { "sym" } else { "asym" };
                let text = format!(
                    "{codes} pack-quantized {sym} ({} ×{scale} {per})",
                    shifted(&codes)
                );
                ("pack-quantized", codes, text)
            }
            Packing::I8 => {
                let sym = if symmetric { "sym" } else { "asym" };
                let text = format!(
                    "INT8 int-quantized {sym} ({} ×{scale} {per})",
                    shifted("INT8")
                );
                ("int-quantized", "INT8".to_string(), text)
            }
            Packing::Fp8 => {
                let text = format!("FP8 ({} ×{scale} {per})", shifted("E4M3"));
                ("float-quantized", "E4M3".to_string(), text)
            }
        };
        Format {
            format,
            codes,
            scale_dtype: scale,
            strategy,
            group_size,
            symmetric,
            text: format!("{text} → {}", self.target),
        }
    }
}

/// For each input tensor a dequantization drops (`dropped`), what it was for and the input
/// tensor of the weight it served: a `Deq`'s scale, global scale and zero point, a
/// packed weight's `weight_shape`, its module's `input_scale` (`deq`: the dequantized
/// weights, by input index).
pub fn companions(
    tensors: &[crate::header::SourceTensor],
    deq: &[(usize, Deq)],
    dropped: impl Fn(usize) -> bool,
) -> Vec<Option<(crate::vocab::Companion, usize)>> {
    use crate::vocab::Companion;
    let mut roles = vec![None; tensors.len()];
    let mut modules = std::collections::HashMap::new();
    for &(i, d) in deq {
        roles[d.scale] = Some((Companion::Scale, i));
        if let Some(z) = d.zero_point {
            roles[z.tensor] = Some((Companion::ZeroPoint, i));
        }
        if let Packing::Nvfp4 { global, .. } = d.packing {
            roles[global] = Some((Companion::GlobalScale, i));
        }
        if let Some(m) = module_of(d.out_name(&tensors[i].name)) {
            modules.insert(m, i);
        }
    }
    for (k, t) in tensors.iter().enumerate() {
        if roles[k].is_some() || !dropped(k) {
            continue;
        }
        let suffixes = [
            (crate::header::WEIGHT_SHAPE_SUFFIX, Companion::Shape),
            (".input_scale", Companion::InputScale),
        ];
        for (suffix, role) in suffixes {
            let module = match t.name.strip_suffix(suffix) {
                Some(m) => m,
                None if t.name == suffix[1..] => "",
                None => continue,
            };
            if let Some(&i) = modules.get(module) {
                roles[k] = Some((role, i));
            }
        }
    }
    roles
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_named() {
        let d = |packing, s_dtype, layout, zp: bool| Deq {
            scale: 1,
            s_dtype,
            zero_point: zp.then_some(ZeroPoint {
                tensor: 2,
                dtype: Dtype::I32,
            }),
            layout,
            rows: 8,
            cols: 64,
            target: Dtype::BF16,
            packing,
            scale_inv: false,
        };
        let nv = Packing::Nvfp4 {
            global: 3,
            scalar: false,
        };
        let f = d(nv, Dtype::F8_E4M3, Layout::Group(16), false).format();
        assert_eq!(f.text, "NVFP4 (E2M1 ×E4M3 per 16 ×F32) → BF16");
        assert_eq!((f.format, f.group_size), ("nvfp4-pack-quantized", Some(16)));
        let f = d(Packing::Mxfp4, Dtype::U8, Layout::Group(32), false).format();
        assert_eq!(f.text, "MXFP4 (E2M1 ×E8M0 per 32) → BF16");
        let g = Packing::GptOss { experts: 4 };
        let f = d(g, Dtype::U8, Layout::Group(32), false).format();
        assert_eq!(
            f.text,
            "gpt-oss MXFP4 (E2M1 ×E8M0 per 32, 4 experts) → BF16"
        );
        assert_eq!(f.format, "mxfp4");
        let int4 = Packing::Int { bits: 4 };
        let f = d(int4, Dtype::BF16, Layout::Group(128), true).format();
        assert_eq!(
            f.text,
            "INT4 pack-quantized asym ((q − zp) ×BF16 per 128) → BF16"
        );
        assert!(!f.symmetric);
        let f = d(int4, Dtype::F32, Layout::Channel, false).format();
        assert_eq!(
            f.text,
            "INT4 pack-quantized sym (INT4 ×F32 per channel) → BF16"
        );
        assert_eq!((f.strategy, f.group_size), ("channel", None));
        let f = d(Packing::I8, Dtype::F16, Layout::Tensor, false).format();
        assert_eq!(
            f.text,
            "INT8 int-quantized sym (INT8 ×F16 per tensor) → BF16"
        );
        let f = d(Packing::Fp8, Dtype::F32, Layout::Block, false).format();
        assert_eq!(f.text, "FP8 (E4M3 ×F32 per 128×128 block) → BF16");
        let mut fp8 = d(Packing::Fp8, Dtype::F8_E8M0, Layout::Group(32), false);
        fp8.target = Dtype::F16;
        assert_eq!(fp8.format().text, "FP8 (E4M3 ×E8M0 per 32) → F16");
    }

    #[test]
    fn the_rule() {
        let c = Strategy::Channel;
        let q = |n: &str| choose(n, Dtype::F32, &[4, 8], c);
        assert!(q("model.layers.0.self_attn.q_proj.weight").is_ok());
        assert!(q("model.layers.0.mlp.experts.3.down_proj.weight").is_ok());
        assert!(q("weight").is_ok());
        assert_eq!(
            q("model.layers.0.input_layernorm.weight"),
            Err(Fp8Skip::Norm)
        );
        assert_eq!(
            q("bert.encoder.layer.0.output.LayerNorm.weight"),
            Err(Fp8Skip::Norm)
        );
        assert_eq!(q("model.norm.weight"), Err(Fp8Skip::Norm));
        assert_eq!(q("lm_head.weight"), Err(Fp8Skip::LmHead));
        for vision in [
            "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight",
            "model.visual.blocks.0.attn.qkv.weight",
            "visual.merger.mlp.0.weight",
            "vision_model.encoder.layers.3.mlp.fc1.weight",
            "model.multi_modal_projector.linear_1.weight",
            "Model.Vision_Tower.x.weight",
        ] {
            assert_eq!(q(vision), Err(Fp8Skip::Vision), "{vision}");
        }
        // The language model beside it is quantized; a norm of the tower is a norm.
        assert!(q("model.language_model.layers.0.self_attn.q_proj.weight").is_ok());
        assert!(q("model.layers.0.mlp.visual_gate_proj.weight").is_ok());
        assert_eq!(q("vision_tower.post_layernorm.weight"), Err(Fp8Skip::Norm));
        assert_eq!(q("model.embed_tokens.weight"), Err(Fp8Skip::Embedding));
        assert_eq!(
            q("bert.embeddings.word_embeddings.weight"),
            Err(Fp8Skip::Embedding)
        );
        assert_eq!(q("transformer.wte.weight"), Err(Fp8Skip::Embedding));
        assert_eq!(q("model.layers.0.mlp.gate.weight"), Err(Fp8Skip::Router));
        assert_eq!(
            q("model.layers.0.block_sparse_moe.gate.weight"),
            Err(Fp8Skip::Router)
        );
        assert_eq!(
            q("model.layers.0.mlp.gate_proj.bias"),
            Err(Fp8Skip::NotWeight)
        );
        assert_eq!(q("model.layers.0.mlp.weight_g"), Err(Fp8Skip::NotWeight));
        let e = choose(
            "model.layers.0.mlp.experts.down_proj.weight",
            Dtype::BF16,
            &[8, 4, 4],
            c,
        );
        assert_eq!(e, Err(Fp8Skip::Experts));
        let e = choose(
            "model.layers.0.mlp.experts.gate_up_proj",
            Dtype::BF16,
            &[8, 4, 4],
            c,
        );
        assert_eq!(e, Err(Fp8Skip::Experts));
        let conv = choose("model.conv1d.weight", Dtype::F32, &[8, 4, 4], c);
        assert_eq!(conv, Err(Fp8Skip::NotMatrix));
        let shared = q("model.layers.0.mlp.shared_expert_gate.weight");
        assert_eq!(shared, Err(Fp8Skip::Router));
        assert_eq!(
            choose("a.weight", Dtype::F32, &[8], c),
            Err(Fp8Skip::NotMatrix)
        );
        assert_eq!(
            choose("a.weight", Dtype::F64, &[8, 8], c),
            Err(Fp8Skip::Dtype)
        );
        assert_eq!(
            choose("a.weight", Dtype::F16, &[0, 8], c),
            Err(Fp8Skip::Empty)
        );
    }

    fn t(name: &str, dtype: Dtype, shape: &[usize]) -> crate::header::SourceTensor {
        crate::header::SourceTensor {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            start: 0,
            end: 0,
            input: 0,
            gather: None,
        }
    }

    #[test]
    fn layouts_of_scales() {
        let l = |s: &[usize], r, c| layout_of(s, r, c);
        assert_eq!(l(&[], 4, 8), Some(Layout::Tensor));
        assert_eq!(l(&[1, 1], 300, 700), Some(Layout::Tensor));
        assert_eq!(l(&[4, 1], 4, 8), Some(Layout::Channel));
        assert_eq!(l(&[3, 6], 257, 700), Some(Layout::Block));
        assert_eq!(l(&[7, 3], 7, 384), Some(Layout::Group(128)));
        assert_eq!(l(&[5, 4], 5, 384), Some(Layout::Group(96)));
        // A one-row weight: block and group give [1, ceil(I/128)]; alike only when the
        // groups are 128 columns wide, else ambiguous.
        assert!(ambiguous(&[1, 2], 1, 200));
        assert!(!ambiguous(&[1, 2], 1, 256));
        assert!(!ambiguous(&[1, 2], 1, 201)); // no group layout: 2 does not divide 201
        assert!(!ambiguous(&[1, 1], 1, 200));
        assert!(!ambiguous(&[1, 2], 2, 200));
        assert_eq!(l(&[1, 2], 1, 256), Some(Layout::Block));
        assert_eq!(l(&[1, 4], 1, 200), Some(Layout::Group(50)));
        assert_eq!(l(&[7, 5], 7, 384), None); // 5 does not divide 384
        assert_eq!(l(&[2, 1], 4, 8), None);
        assert_eq!(l(&[4], 4, 8), None);
        assert_eq!(l(&[4, 1, 1], 4, 8), None);
    }

    #[test]
    fn zero_points_paired_and_dropped() {
        let ts = [
            t("a.weight", Dtype::F8_E4M3, &[4, 8]),
            t("a.weight_scale", Dtype::BF16, &[4, 1]),
            t("a.weight_zero_point", Dtype::F8_E4M3, &[4, 1]),
            t("a.input_scale", Dtype::F32, &[1]),
            t("b.weight", Dtype::F8_E4M3, &[4, 8]),
            t("b.weight_scale", Dtype::F32, &[]),
            t("b.weight_zero_point", Dtype::I32, &[1]),
        ];
        let (deq, dropped) = dequantizable(&ts, &[], Dtype::F16).unwrap();
        let a = deq[0].unwrap();
        assert_eq!(
            a.zero_point,
            Some(ZeroPoint {
                tensor: 2,
                dtype: Dtype::F8_E4M3
            })
        );
        assert_eq!(a.companions().collect::<Vec<_>>(), [1, 2]);
        assert_eq!(deq[4].unwrap().layout, Layout::Tensor);
        assert_eq!(dropped, [false, true, true, true, false, true, true]);
    }

    #[test]
    fn what_is_refused() {
        let w = t("a.weight", Dtype::F8_E4M3, &[4, 8]);
        let refused = |others: &[crate::header::SourceTensor]| {
            let mut ts = vec![w.clone()];
            ts.extend_from_slice(others);
            dequantizable(&ts, &[], Dtype::BF16).unwrap_err()
        };
        let s = t("a.weight_scale", Dtype::F32, &[4, 1]);
        let (n, p) = refused(&[s.clone(), t("a.weight_scale_inv", Dtype::F32, &[4, 1])]);
        assert_eq!(n, "a.weight");
        assert!(matches!(p, Fp8Problem::TwoScales { .. }));
        let (n, p) = refused(&[t("a.weight_scale", Dtype::I32, &[4, 1])]);
        assert_eq!(n, "a.weight_scale");
        assert!(
            matches!(p, Fp8Problem::Dtype { zero_point: false, ref dtype, .. } if dtype == "I32")
        );
        let (n, p) = refused(&[t("a.weight_scale", Dtype::F32, &[2, 1])]);
        assert_eq!(n, "a.weight_scale");
        assert!(matches!(
            p,
            Fp8Problem::Shape {
                zero_point: false,
                ..
            }
        ));
        let zp = |d, shape: &[usize]| t("a.weight_zero_point", d, shape);
        for bad in [
            zp(Dtype::F32, &[4, 1]),
            zp(Dtype::U8, &[4, 1]),
            zp(Dtype::I64, &[4, 1]),
        ] {
            let (n, p) = refused(&[s.clone(), bad]);
            assert_eq!(n, "a.weight_zero_point");
            assert!(matches!(
                p,
                Fp8Problem::Dtype {
                    zero_point: true,
                    ..
                }
            ));
        }
        // Packed (int4 in int32: [O, G/8]) or any other shape than the scale's.
        for shape in [&[4, 2][..], &[4], &[1, 1]] {
            let (_, p) = refused(&[s.clone(), zp(Dtype::I32, shape)]);
            assert!(matches!(
                p,
                Fp8Problem::Shape {
                    zero_point: true,
                    ..
                }
            ));
        }
        // E8M0: compressed-tensors' F8_E8M0 `weight_scale` has no reference; MXFP8's U8
        // scale covers 32 columns.
        let (n, p) = refused(&[t("a.weight_scale", Dtype::F8_E8M0, &[4, 1])]);
        assert_eq!(n, "a.weight_scale");
        assert!(matches!(p, Fp8Problem::Dtype { ref dtype, .. } if dtype == "F8_E8M0"));
        let (n, p) = refused(&[t("a.weight_scale", Dtype::U8, &[4, 1])]);
        assert_eq!(n, "a.weight_scale");
        assert!(matches!(p, Fp8Problem::Packed { format, .. } if format == "mxfp8-quantized"));
        let wide = t("w.weight", Dtype::F8_E4M3, &[4, 64]);
        for (scale, layout) in [
            (t("w.weight_scale", Dtype::U8, &[4, 2]), Layout::Group(32)),
            (
                t("w.weight_scale_inv", Dtype::F8_E8M0, &[4, 2]),
                Layout::Group(32),
            ),
            (t("w.weight_scale_inv", Dtype::U8, &[1, 1]), Layout::Tensor),
        ] {
            let (deq, dropped) = dequantizable(&[wide.clone(), scale], &[], Dtype::BF16).unwrap();
            assert_eq!(deq[0].unwrap().layout, layout);
            assert_eq!(dropped, [false, true]);
        }
        let inv = t("a.weight_scale_inv", Dtype::F32, &[4, 1]);
        let (_, p) = refused(&[inv, zp(Dtype::I8, &[4, 1])]);
        assert!(matches!(p, Fp8Problem::ZeroPointWithScaleInv { .. }));
        let elsewhere = crate::header::SourceTensor {
            input: 1,
            ..zp(Dtype::I8, &[4, 1])
        };
        let (_, p) = refused(&[s.clone(), elsewhere]);
        assert!(matches!(
            p,
            Fp8Problem::NotBeside {
                zero_point: true,
                ..
            }
        ));
        // One scale: the zero point may be any one-element shape.
        let one = [
            w.clone(),
            t("a.weight_scale", Dtype::F32, &[1]),
            zp(Dtype::I8, &[]),
        ];
        assert!(dequantizable(&one, &[], Dtype::BF16).unwrap().0[0].is_some());
    }

    #[test]
    fn packed_weights_paired_renamed_and_refused() {
        let shapes = [("m.weight_shape".to_string(), [6, 100])];
        let ts = [
            t("m.weight_packed", Dtype::I32, &[6, 13]), // ceil(100 * 4 / 32) = 13 words
            t("m.weight_scale", Dtype::BF16, &[6, 4]),
            t("m.weight_shape", Dtype::I64, &[2]),
            t("m.weight_zero_point", Dtype::I32, &[1, 4]), // ceil(6 * 4 / 32) = 1
            t("f.weight_packed", Dtype::U8, &[3, 16]),
            t("f.weight_scale", Dtype::F8_E4M3, &[3, 2]),
            t("f.weight_global_scale", Dtype::F32, &[1]),
            t("e.up_blocks", Dtype::U8, &[2, 5, 3, 16]),
            t("e.up_scales", Dtype::U8, &[2, 5, 3]),
        ];
        let (deq, dropped) = dequantizable(&ts, &shapes, Dtype::BF16).unwrap();
        let m = deq[0].unwrap();
        assert_eq!(m.packing, Packing::Int { bits: 4 });
        assert_eq!((m.rows, m.cols, m.layout), (6, 100, Layout::Group(25)));
        assert_eq!(
            (m.out_name("m.weight_packed"), m.out_shape(&[6, 13])),
            ("m.weight", vec![6, 100])
        );
        assert_eq!((m.src_row(), m.out_row()), (52, 200));
        let f = deq[4].unwrap();
        assert_eq!(
            f.packing,
            Packing::Nvfp4 {
                global: 6,
                scalar: false
            }
        );
        assert_eq!(f.companions().collect::<Vec<_>>(), [5, 6]);
        let e = deq[7].unwrap();
        assert_eq!(e.packing, Packing::GptOss { experts: 2 });
        assert_eq!(
            (e.out_name("e.up_blocks"), e.out_shape(&[2, 5, 3, 16])),
            ("e.up", vec![2, 96, 5])
        );
        assert_eq!(e.out_len(2 * 5 * 3 * 16), 2 * 96 * 5 * 2);
        assert_eq!(
            dropped,
            [false, true, true, true, false, true, true, false, true]
        );
        // No weight_shape: INT4 and INT8 are not told apart; a shape the words cannot hold.
        let (n, p) = dequantizable(&ts[..2], &[], Dtype::BF16).unwrap_err();
        assert!(n == "m.weight_packed" && matches!(p, Fp8Problem::Packed { .. }));
        let wide = [("m.weight_shape".to_string(), [6, 1000])];
        let (n, _) = dequantizable(&ts[..3], &wide, Dtype::BF16).unwrap_err();
        assert_eq!(n, "m.weight_packed");
        // An NVFP4 scale of the wrong shape names the scale.
        let mut bad = ts[4..7].to_vec();
        bad[1] = t("f.weight_scale", Dtype::F8_E4M3, &[3, 4]);
        let (n, _) = dequantizable(&bad, &[], Dtype::BF16).unwrap_err();
        assert_eq!(n, "f.weight_scale");
    }

    #[test]
    fn packed_weights_checked_against_their_config() {
        // INT4 in groups of 25 columns, asymmetric; NVFP4 in groups of 16.
        let shapes = [("m.weight_shape".to_string(), [6, 100])];
        let ts = [
            t("m.weight_packed", Dtype::I32, &[6, 13]),
            t("m.weight_scale", Dtype::BF16, &[6, 4]),
            t("m.weight_shape", Dtype::I64, &[2]),
            t("m.weight_zero_point", Dtype::I32, &[1, 4]),
            t("f.weight_packed", Dtype::U8, &[3, 16]),
            t("f.weight_scale", Dtype::F8_E4M3, &[3, 2]),
            t("f.weight_global_scale", Dtype::F32, &[1]),
        ];
        let (deq, _) = dequantizable(&ts, &shapes, Dtype::BF16).unwrap();
        let int4 = Scheme {
            format: Some("pack-quantized".into()),
            kind: Some("int".into()),
            num_bits: Some(4),
            strategy: Some("group".into()),
            group_size: Some(25),
            symmetric: Some(false),
            targets: vec!["m".into()],
        };
        let nvfp4 = Scheme {
            format: Some("nvfp4-pack-quantized".into()),
            kind: Some("float".into()),
            num_bits: Some(4),
            strategy: Some("tensor_group".into()),
            group_size: Some(16),
            symmetric: Some(true),
            targets: vec!["f".into()],
        };
        let check = |groups: Vec<Scheme>| {
            let schemes = Schemes {
                config: "c/config.json".into(),
                groups,
                ignore: Vec::new(),
            };
            schemes
                .check(&ts, &deq)
                .err()
                .map(|(n, p)| (n, p.to_string()))
        };
        assert_eq!(check(vec![int4.clone(), nvfp4.clone()]), None);
        assert_eq!(check(Vec::new()), None);
        // One scheme for every module: the other weight's format is not it.
        let all = Scheme {
            targets: Vec::new(),
            ..int4.clone()
        };
        let (n, p) = check(vec![all]).unwrap();
        assert_eq!(n, "f.weight_packed");
        assert!(p.contains("format pack-quantized"), "{p}");
        for (bad, says, holds) in [
            (
                Scheme {
                    num_bits: Some(8),
                    ..int4.clone()
                },
                "num_bits 8",
                "4-bit codes",
            ),
            (
                Scheme {
                    group_size: Some(50),
                    ..int4.clone()
                },
                "strategy group, group_size 50",
                "a scale per 25 columns of a row",
            ),
            (
                Scheme {
                    strategy: Some("channel".into()),
                    ..int4.clone()
                },
                "strategy channel",
                "a scale per 25 columns",
            ),
            (
                Scheme {
                    symmetric: Some(true),
                    ..int4.clone()
                },
                "symmetric true",
                "a zero point",
            ),
            (
                Scheme {
                    kind: Some("float".into()),
                    ..int4.clone()
                },
                "type float",
                "int codes",
            ),
        ] {
            let (n, p) = check(vec![bad, nvfp4.clone()]).unwrap();
            assert_eq!(n, "m.weight_packed");
            assert!(p.contains(says) && p.contains(holds), "{p}");
            assert!(p.contains("is a pack-quantized weight") && p.contains("c/config.json"));
        }
        let asym = Scheme {
            symmetric: Some(false),
            ..nvfp4.clone()
        };
        let (n, p) = check(vec![int4.clone(), asym]).unwrap();
        assert_eq!(n, "f.weight_packed");
        assert!(
            p.contains("symmetric false") && p.contains("no zero point"),
            "{p}"
        );
        // A group as wide as the row is one scale per row; what the config leaves out is
        // not checked.
        let wide = Scheme {
            group_size: Some(1000),
            strategy: Some("group".into()),
            ..Scheme::default()
        };
        let ts1 = [
            t("m.weight_packed", Dtype::I32, &[6, 13]),
            t("m.weight_scale", Dtype::BF16, &[6, 1]),
            t("m.weight_shape", Dtype::I64, &[2]),
        ];
        let (deq1, _) = dequantizable(&ts1, &shapes, Dtype::BF16).unwrap();
        let schemes = Schemes {
            config: "c".into(),
            groups: vec![wide],
            ignore: Vec::new(),
        };
        assert!(schemes.check(&ts1, &deq1).is_ok());
    }

    #[test]
    fn each_packed_weight_is_checked_against_the_group_that_targets_it() {
        // Two groups: INT4 (group 25, asymmetric) for `m`, NVFP4 for `re:f.*`.
        let shapes = [("m.weight_shape".to_string(), [6, 100])];
        let ts = [
            t("m.weight_packed", Dtype::I32, &[6, 13]),
            t("m.weight_scale", Dtype::BF16, &[6, 4]),
            t("m.weight_shape", Dtype::I64, &[2]),
            t("m.weight_zero_point", Dtype::I32, &[1, 4]),
            t("f.weight_packed", Dtype::U8, &[3, 16]),
            t("f.weight_scale", Dtype::F8_E4M3, &[3, 2]),
            t("f.weight_global_scale", Dtype::F32, &[1]),
        ];
        let (deq, _) = dequantizable(&ts, &shapes, Dtype::BF16).unwrap();
        let int4 = Scheme {
            format: Some("pack-quantized".into()),
            kind: Some("int".into()),
            num_bits: Some(4),
            strategy: Some("group".into()),
            group_size: Some(25),
            symmetric: Some(false),
            targets: vec!["m".into()],
        };
        let nvfp4 = Scheme {
            format: Some("nvfp4-pack-quantized".into()),
            kind: Some("float".into()),
            num_bits: Some(4),
            targets: vec!["re:f$".into()],
            ..Scheme::default()
        };
        let check = |groups: Vec<Scheme>, ignore: &[&str]| {
            let schemes = Schemes {
                config: "c.json".into(),
                groups,
                ignore: ignore.iter().map(|s| s.to_string()).collect(),
            };
            schemes
                .check(&ts, &deq)
                .err()
                .map(|(n, p)| (n, p.to_string()))
        };
        assert_eq!(check(vec![int4.clone(), nvfp4.clone()], &[]), None);
        assert_eq!(check(vec![nvfp4.clone(), int4.clone()], &["lm_head"]), None);
        // Each weight is judged by its own group: an NVFP4 group that says 8 bits names f,
        // though the INT4 group would describe it no better.
        let eight = Scheme {
            num_bits: Some(8),
            ..nvfp4.clone()
        };
        let (n, p) = check(vec![int4.clone(), eight], &[]).unwrap();
        assert!(n == "f.weight_packed" && p.contains("num_bits 8"), "{p}");
        // Targets that name neither, an ignored module, `Linear`, `re:` at the start only.
        let (n, p) = check(vec![int4.clone()], &[]).unwrap();
        assert!(
            n == "f.weight_packed" && p.contains("no config group's `targets` names module `f`"),
            "{p}"
        );
        let (n, p) = check(vec![int4.clone(), nvfp4.clone()], &["re:m"]).unwrap();
        assert!(
            n == "m.weight_packed" && p.contains("`ignore` entry `re:m` names module `m`"),
            "{p}"
        );
        let linear = Scheme {
            targets: vec!["Linear".into()],
            ..nvfp4.clone()
        };
        assert_eq!(check(vec![int4.clone(), linear], &["re:x"]), None);
        let inner = Scheme {
            targets: vec!["re:f".into()],
            ..nvfp4.clone()
        };
        assert_eq!(check(vec![int4.clone(), inner], &["re:.m"]), None);
        // An FP8 weight's zero point against its group's symmetry (a symmetric scheme's
        // dequantization leaves a zero point unread); an FP8 module no group targets is not
        // judged here.
        let fp8 = [
            t("q.weight", Dtype::F8_E4M3, &[4, 8]),
            t("q.weight_scale", Dtype::BF16, &[4, 1]),
            t("q.weight_zero_point", Dtype::I8, &[4, 1]),
        ];
        let (fdeq, _) = dequantizable(&fp8, &[], Dtype::BF16).unwrap();
        let float = |symmetric, targets: &[&str]| Scheme {
            format: Some("float-quantized".into()),
            symmetric: Some(symmetric),
            targets: targets.iter().map(|s| s.to_string()).collect(),
            ..Scheme::default()
        };
        let judge = |g: Scheme| {
            let schemes = Schemes {
                config: "c.json".into(),
                groups: vec![g],
                ignore: Vec::new(),
            };
            schemes
                .check(&fp8, &fdeq)
                .err()
                .map(|(n, p)| (n, p.to_string()))
        };
        assert_eq!(judge(float(false, &["Linear"])), None);
        assert_eq!(judge(float(true, &["x"])), None);
        // An asymmetric group over an FP8 weight without its zero point: refused.
        let (fdeq2, _) = dequantizable(&fp8[..2], &[], Dtype::BF16).unwrap();
        let asym = Schemes {
            config: "c.json".into(),
            groups: vec![float(false, &["Linear"])],
            ignore: Vec::new(),
        };
        let (n, p) = asym.check(&fp8[..2], &fdeq2).err().unwrap();
        let p = p.to_string();
        assert!(
            n == "q.weight" && p.contains("symmetric false") && p.contains("no zero point"),
            "{p}"
        );
        let (n, p) = judge(float(true, &["re:q"])).unwrap();
        assert!(
            n == "q.weight" && p.contains("symmetric true") && p.contains("a zero point"),
            "{p}"
        );
        // A pattern the regex crate cannot read as Python's re: refused, naming it.
        for bad in ["re:(?=f)", "re:[[:alpha:]]", "re:f\\Z"] {
            let look = Scheme {
                targets: vec![bad.into()],
                ..nvfp4.clone()
            };
            let (_, p) = check(vec![int4.clone(), look], &[]).unwrap();
            assert!(
                p.contains(&format!("the pattern `{bad}`")) && p.contains("Python's re"),
                "{p}"
            );
        }
    }

    #[test]
    fn groups_and_scales() {
        let q = Quant {
            d: Dtype::F32,
            strategy: Strategy::Block,
            rows: 300,
            cols: 130,
        };
        assert_eq!(q.scale_shape(), [3, 2]);
        assert_eq!(q.scale_len(), 24);
        assert_eq!(q.granule(), 128 * 130 * 4);
        let c = Quant {
            strategy: Strategy::Channel,
            d: Dtype::BF16,
            ..q
        };
        assert_eq!(
            (c.scale_shape(), c.scale_len(), c.granule()),
            ([300, 1], 600, 260)
        );
        let w = [
            ("m.q_proj.weight", 96),
            ("m.k_proj.weight", 128),
            ("m.v_proj.weight", 8),
        ];
        assert_eq!(misfit_fused_parts(w.into_iter()), ["m.q_proj"]);
    }
}
