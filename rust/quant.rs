//! FP8 targets: which weights are quantized, how their groups and scales are laid out, and
//! the warnings vLLM's constraints call for. The arithmetic is `fp8`'s.
//!
//! The rule (stcast's, close to llm-compressor's `model_free_ptq`, see docs/guide.md): a
//! tensor is quantized when it is a 2-D F32, F16 or BF16 tensor named `*.weight`, not kept
//! by a `keep` pattern, and its module is none of: a norm (a name ending in `norm`, any
//! case), an embedding, the output head, a MoE router gate. 3-D fused experts stay BF16.

use safetensors::tensor::Dtype;

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

/// How a quantized input's weight maps to its scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// One scale for the whole tensor (`[]` or `[1]`).
    Tensor,
    /// One per row (`[O, 1]`).
    Channel,
    /// One per 128x128 tile (`[ceil(O/128), ceil(I/128)]`).
    Block,
}

/// An FP8 input weight to dequantize: E4M3 `rows x cols`, its scale (input tensor `scale`,
/// of dtype `s_dtype`), the target dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deq {
    pub scale: usize,
    pub s_dtype: Dtype,
    pub layout: Layout,
    pub rows: u64,
    pub cols: u64,
    pub target: Dtype,
}

impl Deq {
    /// Bytes per output element.
    pub fn out_size(&self) -> u64 {
        (self.target.bitsize() / 8) as u64
    }
}

/// The names a quantized checkpoint gives a weight's scale: compressed-tensors'
/// `weight_scale`, DeepSeek's `weight_scale_inv` (both multiply).
pub const SCALE_SUFFIXES: [&str; 2] = ["_scale", "_scale_inv"];

/// The FP8 weights of an input that can be dequantized to `target` (BF16 or F16): an
/// F8_E4M3 2-D `X.weight` with `X.weight_scale` or `X.weight_scale_inv` in F32, BF16 or F16,
/// shaped per tensor, channel or 128x128 block. Returns, per input tensor, the weight's
/// `Deq`; and which input tensors are its scales, or activation scales (`X.input_scale`)
/// that mean nothing once dequantized: dropped.
pub fn dequantizable(
    tensors: &[crate::header::SourceTensor],
    target: Dtype,
) -> (Vec<Option<Deq>>, Vec<bool>) {
    use std::collections::HashMap;
    let by_name: HashMap<&str, usize> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut deq = vec![None; tensors.len()];
    let mut dropped = vec![false; tensors.len()];
    for (i, t) in tensors.iter().enumerate() {
        if t.dtype != Dtype::F8_E4M3 || t.shape.len() != 2 || t.gather.is_some() {
            continue;
        }
        let Some(module) = module_of(&t.name) else {
            continue;
        };
        let (rows, cols) = (t.shape[0] as u64, t.shape[1] as u64);
        let found = SCALE_SUFFIXES.iter().find_map(|suffix| {
            let k = *by_name.get(format!("{}{suffix}", t.name).as_str())?;
            let s = &tensors[k];
            let ok_dtype = matches!(s.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16);
            if !ok_dtype || s.gather.is_some() || s.input != t.input {
                return None;
            }
            let n: usize = s.shape.iter().product();
            let layout = if n == 1 && s.shape.len() <= 2 {
                Layout::Tensor
            } else if s.shape == [rows as usize, 1] {
                Layout::Channel
            } else if s.shape == [rows.div_ceil(BLOCK) as usize, cols.div_ceil(BLOCK) as usize] {
                Layout::Block
            } else {
                return None;
            };
            Some((k, s.dtype, layout))
        });
        if let Some((k, s_dtype, layout)) = found {
            deq[i] = Some(Deq {
                scale: k,
                s_dtype,
                layout,
                rows,
                cols,
                target,
            });
            dropped[k] = true;
            if let Some(&k) = by_name.get(input_scale_name(module).as_str()) {
                dropped[k] = true;
            }
        }
    }
    (deq, dropped)
}

/// The name of module `module`'s activation scale (static FP8 activations).
pub fn input_scale_name(module: &str) -> String {
    if module.is_empty() {
        "input_scale".to_string()
    } else {
        format!("{module}.input_scale")
    }
}

/// The scale tensor's name for weight `name`.
pub fn scale_name(name: &str) -> String {
    format!("{name}_scale")
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

#[cfg(test)]
mod tests {
    use super::*;

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
