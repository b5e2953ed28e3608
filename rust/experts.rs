//! Fused MoE experts under an FP8 target: a 3-D `gate_up_proj` or `down_proj` split into
//! the per-expert 2-D weights llm-compressor's `model_free_ptq` makes of it
//! (`split_fused_moe_experts`), so that each is quantized as any weight is.
//!
//! transformers >= 5 holds experts fused: `mlp.experts.gate_up_proj` `[E, 2I, H]` (gate
//! rows, then up rows) and `mlp.experts.down_proj` `[E, H, I]`. They become
//! `mlp.experts.{e}.gate_proj.weight` and `.up_proj.weight` `[I, H]` (the two halves of
//! dim 1) and `mlp.experts.{e}.down_proj.weight` `[H, I]`, named as `model_free_ptq` names
//! them (the fused name's `gate_up_proj` replaced by `{e}.gate_proj`, `.weight` appended
//! where missing). Each piece of that layout is one run of the fused tensor's bytes: the
//! split renames byte ranges, nothing is copied.
//!
//! Qwen3-VL-MoE and Llama 4 store them transposed (`[E, H, 2I]`, `[E, I, H]`): each piece
//! is then the transpose of a block, read as a strided view (`gather::Gather::View`, walked
//! in blocks of columns: bounded memory whatever the size). `model_free_ptq` splits such a
//! tensor along H, which is wrong; stcast does not.
//!
//! The layout is proven from the shapes against the model config's `hidden_size` and
//! `moe_intermediate_size` (else `intermediate_size`), top level or `text_config`. Where it
//! cannot be told (no config, `2I == H` for `gate_up_proj`, `H == I` for `down_proj`),
//! where the shapes fit neither layout, where the tensor is stored in pieces (a
//! distributed checkpoint), and for gpt-oss (its `gate_up_proj` interleaves gate and up
//! columns, and has biases), the tensor stays fused and BF16, and the plan's warning says
//! why (`Left`). A fused tensor a `keep` pattern names (by its own name, as the input holds
//! it) stays fused too, kept in its dtype as any tensor a pattern keeps, and so does the
//! other fused tensor of its experts (BF16: a block is split whole or not at all).

use std::collections::HashMap;

use safetensors::Dtype;

use crate::gather::Gather;
use crate::header::SourceTensor;
use crate::source::Source;
use crate::torch::TensorDesc;

/// What a model config says of its experts' sizes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Model {
    pub hidden: u64,
    pub intermediate: u64,
    /// `model_type` (of the top level), if given.
    pub model_type: Option<String>,
}

/// The model types whose `gate_up_proj` is not two halves (gpt-oss interleaves gate and up
/// columns: `gate_up[..., ::2]`, `gate_up[..., 1::2]`).
const INTERLEAVED: [&str; 1] = ["gpt_oss"];

impl Model {
    /// The model config `text` says (None: it gives no hidden and intermediate size), or
    /// why it is not JSON.
    pub fn of_config(text: &str) -> Result<Option<Model>, String> {
        let doc: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let model_type = doc
            .get("model_type")
            .and_then(|v| v.as_str())
            .map(String::from);
        let sizes = |d: &serde_json::Value| {
            let n = |k: &str| d.get(k).and_then(|v| v.as_u64()).filter(|&n| n > 0);
            let intermediate = n("moe_intermediate_size").or_else(|| n("intermediate_size"));
            Some((n("hidden_size")?, intermediate?))
        };
        let found = sizes(&doc).or_else(|| doc.get("text_config").and_then(sizes));
        Ok(found.map(|(hidden, intermediate)| Model {
            hidden,
            intermediate,
            model_type,
        }))
    }

    /// What a folder run's model config `text` says (`of_config`), when it also declares
    /// experts (a positive `num_experts`, `num_local_experts`, `n_routed_experts`, ...: a
    /// key holding `experts`, top level or in `text_config`): a dense model's config (a
    /// Llama's gives both sizes too) splits nothing, and its outputs record no sizes.
    pub fn of_folder_config(text: &str) -> Result<Option<Model>, String> {
        let doc: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let declares = |d: &serde_json::Value| {
            d.as_object().is_some_and(|o| {
                o.iter()
                    .any(|(k, v)| k.contains("experts") && v.as_u64().is_some_and(|n| n > 0))
            })
        };
        if !declares(&doc) && !doc.get("text_config").is_some_and(declares) {
            return Ok(None);
        }
        Model::of_config(text)
    }

    /// The sizes an output records (`record::Record::experts`): what verify splits by.
    pub fn sizes(&self) -> [u64; 2] {
        [self.hidden, self.intermediate]
    }

    /// The model of recorded sizes.
    pub fn of_sizes([hidden, intermediate]: [u64; 2]) -> Model {
        Model {
            hidden,
            intermediate,
            model_type: None,
        }
    }
}

/// Which fused tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `gate_up_proj`: gate and up, `[E, 2I, H]`.
    GateUp,
    /// `down_proj`: `[E, H, I]`.
    Down,
}

impl Kind {
    /// The fused name's part, and the parts its pieces are named by.
    fn parts(self) -> (&'static str, &'static [&'static str]) {
        match self {
            Kind::GateUp => ("gate_up_proj", &["gate_proj", "up_proj"]),
            Kind::Down => ("down_proj", &["down_proj"]),
        }
    }
}

/// How a fused tensor lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Each expert's pieces are its rows: `[E, 2I, H]`, `[E, H, I]`.
    Rows,
    /// Each expert's pieces are transposed: `[E, H, 2I]`, `[E, I, H]`.
    Transposed,
}

/// Why a fused tensor stays fused (and BF16).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Left {
    /// No model config gives the sizes that tell its layout.
    NoConfig,
    /// Both layouts give its shape (`2I == H`, or `H == I`).
    Ambiguous,
    /// Its shape is neither layout of the config's sizes.
    Misfit,
    /// gpt-oss: gate and up interleaved.
    Interleaved,
    /// Stored in pieces (a distributed checkpoint's boxes).
    Pieces,
    /// Its own layout is told, but the other fused tensor of its experts stays fused.
    Partner,
    /// A `keep` pattern names it: kept as it is, not split.
    Kept,
}

impl Left {
    /// Why, in words (after "stay BF16, unquantized").
    pub fn words(self) -> &'static str {
        match self {
            Left::NoConfig => {
                "no model config gives the hidden_size and (moe_)intermediate_size that tell \
                 how they lie: {config} gives a lone file's, a folder's config.json (declaring \
                 its experts: num_experts, num_local_experts, ...) a folder's"
            }
            Left::Ambiguous => {
                "their shape fits both the [E, 2I, H] and the transposed [E, H, 2I] layout of \
                 the model config's sizes, so which one is not told"
            }
            Left::Misfit => "their shape is no layout of the model config's sizes",
            Left::Interleaved => "gpt-oss interleaves gate and up columns",
            Left::Pieces => "they are stored in pieces of a distributed checkpoint",
            Left::Partner => {
                "the other fused tensor of their experts stays fused, and a block of experts \
                 is split whole or not at all"
            }
            Left::Kept => "a {keep} pattern names them",
        }
    }
}

/// Is a tensor of this name, dtype and shape a fused expert tensor, and which?
pub fn kind(name: &str, dtype: Dtype, shape: &[usize]) -> Option<Kind> {
    let float = matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16);
    if shape.len() != 3 || !float {
        return None;
    }
    let stem = name.strip_suffix(".weight").unwrap_or(name);
    [Kind::GateUp, Kind::Down]
        .into_iter()
        .find(|k| stem.ends_with(k.parts().0))
}

/// How fused tensor `kind` of `shape` (`[E, a, b]`) lies under `model`, or why it stays.
pub fn layout(kind: Kind, shape: &[usize], model: Option<&Model>) -> Result<Layout, Left> {
    let m = model.ok_or(Left::NoConfig)?;
    if m.model_type
        .as_deref()
        .is_some_and(|t| INTERLEAVED.contains(&t))
    {
        return Err(Left::Interleaved);
    }
    let (h, i) = (m.hidden, m.intermediate);
    // A config's sizes are any numbers: one too large to double fits no shape.
    let rows = match kind {
        Kind::GateUp => (i.checked_mul(2).ok_or(Left::Misfit)?, h),
        Kind::Down => (h, i),
    };
    let got = (shape[1] as u64, shape[2] as u64);
    match (got == rows, got == (rows.1, rows.0)) {
        (true, true) => Err(Left::Ambiguous),
        (true, false) => Ok(Layout::Rows),
        (false, true) => Ok(Layout::Transposed),
        (false, false) => Err(Left::Misfit),
    }
}

/// Why a fused expert tensor stays fused (None: it is none, or it is split). `kept`: does a
/// `keep` pattern name a tensor?
pub fn left(
    t: &SourceTensor,
    all: &[SourceTensor],
    model: Option<&Model>,
    kept: &dyn Fn(&str) -> bool,
) -> Option<Left> {
    if let Some(why) = own_reason(t, model, kept) {
        return Some(why);
    }
    // Its own layout is told, but another fused tensor of its block stays.
    let block = block_of(&t.name, kind(&t.name, t.dtype, &t.shape)?)?;
    all.iter()
        .filter(|o| o.name != t.name)
        .filter(|o| {
            let k = kind(&o.name, o.dtype, &o.shape);
            k.and_then(|k| block_of(&o.name, k)) == Some(block)
        })
        .any(|o| own_reason(o, model, kept).is_some())
        .then_some(Left::Partner)
}

/// Why fused tensor `t` cannot be split by itself, if it cannot (`kept`: as `left`).
fn own_reason(
    t: &SourceTensor,
    model: Option<&Model>,
    kept: &dyn Fn(&str) -> bool,
) -> Option<Left> {
    let k = kind(&t.name, t.dtype, &t.shape)?;
    if kept(&t.name) {
        return Some(Left::Kept);
    }
    if matches!(t.gather.as_deref(), Some(Gather::Pieces(_))) {
        return Some(Left::Pieces);
    }
    layout(k, &t.shape, model).err()
}

/// The block of experts fused tensor `name` (of `kind`) belongs to: its name before the
/// fused tensor's (`model.layers.0.mlp.experts.`).
fn block_of(name: &str, kind: Kind) -> Option<&str> {
    let stem = name.strip_suffix(".weight").unwrap_or(name);
    stem.strip_suffix(kind.parts().0)
}

/// The name `model_free_ptq` gives piece `part` of expert `e` of fused tensor `name`.
fn piece_name(name: &str, fused: &str, e: u64, part: &str) -> String {
    let out = name.replace(fused, &format!("{e}.{part}"));
    if out.ends_with(".weight") {
        out
    } else {
        out + ".weight"
    }
}

/// The names of the fused tensor a piece named `name` may have been split from (as
/// `piece_name` names it: with and without `.weight`); none if it is no piece's name.
pub fn fused_names(name: &str) -> Vec<String> {
    let Some(stem) = name.strip_suffix(".weight") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for kind in [Kind::GateUp, Kind::Down] {
        let (fused, parts) = kind.parts();
        for part in parts {
            let Some(rest) = stem.strip_suffix(part).and_then(|r| r.strip_suffix('.')) else {
                continue;
            };
            let digits = rest.len() - rest.trim_end_matches(|c: char| c.is_ascii_digit()).len();
            if digits == 0 {
                continue;
            }
            let base = &rest[..rest.len() - digits];
            out.push(format!("{base}{fused}"));
            out.push(format!("{base}{fused}.weight"));
        }
    }
    out
}

/// Split every fused expert tensor of `source` whose layout `model` proves into its
/// per-expert weights, in place (expert by expert, gate before up). Returns each piece's
/// name with its fused tensor's (empty: none was split). One whose pieces would take a name the source has already (or another
/// fused tensor's pieces have) stays fused: a file never holds one name twice; so does one a
/// `keep` pattern names (`kept`: does one name a tensor?), with its block.
pub fn split(
    source: &mut Source,
    model: &Model,
    kept: &dyn Fn(&str) -> bool,
) -> HashMap<String, String> {
    let tensors = std::mem::take(&mut source.header.tensors);
    let mut transposed = Vec::new();
    let mut names: std::collections::HashSet<String> =
        tensors.iter().map(|t| t.name.clone()).collect();
    let mut out = Vec::with_capacity(tensors.len());
    let mut split = HashMap::new();
    // The experts of one block are split together or not at all: a fused gate_up_proj
    // beside per-expert down_proj weights is no layout a loader reads as one scheme.
    let stays: std::collections::HashSet<&str> = tensors
        .iter()
        .filter(|t| own_reason(t, Some(model), kept).is_some())
        .filter_map(|t| block_of(&t.name, kind(&t.name, t.dtype, &t.shape)?))
        .collect();
    let stays: std::collections::HashSet<String> = stays.into_iter().map(String::from).collect();
    for t in tensors {
        let Some(k) = kind(&t.name, t.dtype, &t.shape) else {
            out.push(t);
            continue;
        };
        if block_of(&t.name, k).is_some_and(|b| stays.contains(b)) {
            out.push(t);
            continue;
        }
        let laid = layout(k, &t.shape, Some(model));
        let pieces = match (laid, t.gather.as_deref()) {
            (Ok(l), None) => {
                let base = source.files[t.input].base;
                pieces(&t, k, l, model, &contiguous(&t, base))
            }
            (Ok(l), Some(Gather::View(desc))) => pieces(&t, k, l, model, desc),
            _ => None,
        };
        let mut seen = std::collections::HashSet::new();
        let mut free = |p: &Vec<SourceTensor>| {
            p.iter()
                .all(|q| !names.contains(&q.name) && seen.insert(q.name.clone()))
        };
        match pieces.filter(|p| !p.is_empty() && free(p)) {
            Some(p) => {
                if laid == Ok(Layout::Transposed) {
                    transposed.push(t.name.clone());
                }
                names.extend(p.iter().map(|q| q.name.clone()));
                split.extend(p.iter().map(|q| (q.name.clone(), t.name.clone())));
                out.extend(p);
            }
            None => out.push(t),
        }
    }
    source.header.tensors = out;
    source.transposed = transposed;
    split
}

/// The note that fused experts stored transposed (`[E, H, 2I]`, `[E, I, H]`: Qwen3-VL-MoE,
/// Llama 4) were split per expert along the dimension that holds their rows, as
/// transformers reads them: `model_free_ptq` splits such a tensor along H, so its output
/// and stcast's differ there.
pub fn transposed_note(names: &[String]) -> crate::error::Warning {
    crate::error::Warning::new(
        crate::vocab::WarningKind::TransposedExperts,
        format!(
            "{} of fused MoE experts stored transposed ([E, H, 2I], [E, I, H]: Qwen3-VL-MoE, \
             Llama 4) {} split per expert along the last dimension, as transformers reads \
             {} (llm-compressor's model_free_ptq splits such a tensor along H, which is \
             wrong): {}",
            crate::text::count(names.len() as u64, "weight"),
            if names.len() == 1 { "is" } else { "are" },
            if names.len() == 1 { "it" } else { "them" },
            crate::text::name_list(names.iter().map(String::as_str), 5)
        ),
    )
}

/// A contiguous tensor of its file, as a view (`base`: where its file's data start).
fn contiguous(t: &SourceTensor, base: u64) -> TensorDesc {
    let es = (t.dtype.bitsize() / 8) as u64;
    let shape: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
    let stride = vec![shape[1] * shape[2], shape[2], 1];
    TensorDesc {
        dtype: t.dtype,
        torch_dtype: crate::torch::dtype::DTYPES
            .iter()
            .find(|d| d.safetensors == Some(t.dtype))
            .map_or("", |d| d.name),
        shape,
        stride,
        storage_offset: 0,
        storage: 0,
        data_start: base + t.start,
        data_len: t.len() / es.max(1) * es,
        big_endian: false,
    }
}

/// The pieces of fused tensor `t` (`kind`, lying as `layout`), its view `desc`: each a
/// contiguous run of `t`'s file where the view makes it one, else a strided view.
fn pieces(
    t: &SourceTensor,
    kind: Kind,
    layout: Layout,
    model: &Model,
    desc: &TensorDesc,
) -> Option<Vec<SourceTensor>> {
    let (fused, parts) = kind.parts();
    let es = desc.elem_size();
    let [s0, s1, s2] = desc.stride[..] else {
        return None;
    };
    let (experts, a, b) = (desc.shape[0], desc.shape[1], desc.shape[2]);
    // Rows of a piece along the split dimension (dim 1 for rows, dim 2 transposed).
    let rows = match kind {
        Kind::GateUp => model.intermediate,
        Kind::Down => match layout {
            Layout::Rows => a,
            Layout::Transposed => b,
        },
    };
    let mut out = Vec::with_capacity((experts as usize) * parts.len());
    for e in 0..experts {
        for (p, part) in parts.iter().enumerate() {
            let p = p as u64;
            // The piece's shape and strides: [rows, cols] of the expert's block.
            let (offset, shape, stride) = match layout {
                Layout::Rows => (e * s0 + p * rows * s1, [rows, b], [s1, s2]),
                Layout::Transposed => (e * s0 + p * rows * s2, [rows, a], [s2, s1]),
            };
            let view = TensorDesc {
                shape: shape.to_vec(),
                stride: stride.to_vec(),
                storage_offset: desc.storage_offset + offset,
                ..desc.clone()
            };
            let len = shape[0] * shape[1] * es;
            let name = piece_name(&t.name, fused, e, part);
            let dims = vec![shape[0] as usize, shape[1] as usize];
            let tensor = match view.contiguous_range() {
                // A run of the tensor's own file (little-endian, not gathered before).
                Some(r) if t.gather.is_none() && !view.big_endian => {
                    let start = r.start - (desc.data_start - t.start);
                    SourceTensor {
                        name,
                        dtype: t.dtype,
                        shape: dims,
                        start,
                        end: start + len,
                        input: t.input,
                        gather: None,
                    }
                }
                _ => {
                    let start = t.start + offset * es;
                    SourceTensor {
                        name,
                        dtype: t.dtype,
                        shape: dims,
                        start,
                        end: start + len,
                        input: t.input,
                        gather: Some(Box::new(Gather::View(view))),
                    }
                }
            };
            out.push(tensor);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(h: u64, i: u64) -> Model {
        Model {
            hidden: h,
            intermediate: i,
            model_type: None,
        }
    }

    #[test]
    fn configs_give_sizes_top_level_or_text_config() {
        let m = Model::of_config(
            r#"{"model_type":"qwen3_moe","hidden_size":8,"intermediate_size":99,"moe_intermediate_size":4}"#,
        );
        assert_eq!(
            m.unwrap(),
            Some(Model {
                hidden: 8,
                intermediate: 4,
                model_type: Some("qwen3_moe".into())
            })
        );
        let vl = r#"{"model_type":"qwen3_vl_moe","text_config":{"hidden_size":8,"moe_intermediate_size":4}}"#;
        assert_eq!(Model::of_config(vl).unwrap().unwrap().sizes(), [8, 4]);
        let llama4 = r#"{"text_config":{"hidden_size":8,"intermediate_size":6}}"#;
        assert_eq!(Model::of_config(llama4).unwrap().unwrap().sizes(), [8, 6]);
        assert_eq!(Model::of_config(r#"{"hidden_size":8}"#).unwrap(), None);
        assert!(Model::of_config("{").is_err());
    }

    #[test]
    fn a_fused_tensor_a_keep_pattern_names_stays_fused_with_its_block() {
        // Attack z11 r12: the pattern names the fused tensor as the input holds it.
        let dir = crate::testutil::folder("experts-kept", &[]);
        let path = dir.join("m.safetensors");
        let a = 2 * 6 * 8 * 4;
        let header = format!(
            "{{\"l0.mlp.experts.gate_up_proj\":{{\"dtype\":\"F32\",\"shape\":[2,6,8],\"data_offsets\":[0,{a}]}},\
             \"l0.mlp.experts.down_proj\":{{\"dtype\":\"F32\",\"shape\":[2,8,3],\"data_offsets\":[{a},{}]}},\
             \"l1.mlp.experts.gate_up_proj\":{{\"dtype\":\"F32\",\"shape\":[2,6,8],\"data_offsets\":[{},{}]}},\
             \"l1.mlp.experts.down_proj\":{{\"dtype\":\"F32\",\"shape\":[2,8,3],\"data_offsets\":[{},{}]}}}}",
            a + 192,
            a + 192,
            2 * a + 192,
            2 * a + 192,
            2 * a + 384
        );
        let header = header.clone() + &" ".repeat((8 - header.len() % 8) % 8);
        std::fs::write(&path, crate::testutil::file(&header, 2 * a + 384)).unwrap();
        let opts = |keep: &[&str]| {
            crate::input::InputOptions::default().with_experts(
                Some(model(8, 3)),
                &keep.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
            )
        };
        let names = |keep: &[&str]| -> Vec<String> {
            let source = Source::open_any(&path, &opts(keep)).unwrap();
            source
                .header
                .tensors
                .iter()
                .map(|t| t.name.clone())
                .collect()
        };
        let all = names(&[]);
        assert!(!all.iter().any(|n| n.ends_with("_proj")), "{all:?}");
        // Kept, with its block; the other layer's are split.
        let kept = names(&["l0.mlp.experts.gate_up_proj"]);
        assert!(kept.contains(&"l0.mlp.experts.gate_up_proj".to_string()));
        assert!(kept.contains(&"l0.mlp.experts.down_proj".to_string()));
        assert!(kept.contains(&"l1.mlp.experts.1.gate_proj.weight".to_string()));
        // A pattern of the pieces' names leaves the split as it is.
        assert_eq!(names(&["*experts.0.*"]), all);
        let source = Source::open_any(&path, &opts(&["l0.*gate_up*"])).unwrap();
        let kept = |n: &str| n.starts_with("l0.") && n.contains("gate_up");
        let t = &source.header.tensors;
        let left_of = |name: &str| {
            let t0 = t.iter().find(|x| x.name == name).unwrap();
            left(t0, t, Some(&model(8, 3)), &kept)
        };
        assert_eq!(left_of("l0.mlp.experts.gate_up_proj"), Some(Left::Kept));
        assert_eq!(left_of("l0.mlp.experts.down_proj"), Some(Left::Partner));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn layouts_are_proven_from_shapes() {
        let m = model(8, 3);
        assert_eq!(layout(Kind::GateUp, &[2, 6, 8], Some(&m)), Ok(Layout::Rows));
        assert_eq!(
            layout(Kind::GateUp, &[2, 8, 6], Some(&m)),
            Ok(Layout::Transposed)
        );
        assert_eq!(layout(Kind::Down, &[2, 8, 3], Some(&m)), Ok(Layout::Rows));
        assert_eq!(
            layout(Kind::Down, &[2, 3, 8], Some(&m)),
            Ok(Layout::Transposed)
        );
        assert_eq!(layout(Kind::Down, &[2, 3, 9], Some(&m)), Err(Left::Misfit));
        assert_eq!(layout(Kind::Down, &[2, 8, 3], None), Err(Left::NoConfig));
        let huge = model(8, u64::MAX);
        assert_eq!(
            layout(Kind::GateUp, &[2, 6, 8], Some(&huge)),
            Err(Left::Misfit)
        );
        let square = model(8, 4);
        assert_eq!(
            layout(Kind::GateUp, &[2, 8, 8], Some(&square)),
            Err(Left::Ambiguous)
        );
        let gpt = Model {
            model_type: Some("gpt_oss".into()),
            ..model(8, 3)
        };
        assert_eq!(
            layout(Kind::GateUp, &[2, 8, 6], Some(&gpt)),
            Err(Left::Interleaved)
        );
        assert_eq!(
            kind("m.experts.gate_up_proj", Dtype::BF16, &[2, 6, 8]),
            Some(Kind::GateUp)
        );
        assert_eq!(
            kind("m.experts.down_proj.weight", Dtype::F32, &[2, 8, 3]),
            Some(Kind::Down)
        );
        assert_eq!(
            kind("m.experts.gate_up_proj_bias", Dtype::BF16, &[2, 6, 8]),
            None
        );
        assert_eq!(kind("m.experts.down_proj", Dtype::I8, &[2, 8, 3]), None);
        assert_eq!(kind("m.experts.down_proj", Dtype::BF16, &[8, 3]), None);
        assert_eq!(
            piece_name("m.experts.gate_up_proj", "gate_up_proj", 3, "up_proj"),
            "m.experts.3.up_proj.weight"
        );
        assert_eq!(
            piece_name("m.experts.down_proj.weight", "down_proj", 0, "down_proj"),
            "m.experts.0.down_proj.weight"
        );
        assert_eq!(
            fused_names("m.experts.12.up_proj.weight"),
            ["m.experts.gate_up_proj", "m.experts.gate_up_proj.weight"]
        );
        assert_eq!(
            fused_names("m.experts.0.down_proj.weight")[0],
            "m.experts.down_proj"
        );
        assert!(fused_names("m.experts.x.down_proj.weight").is_empty());
        assert!(fused_names("m.experts.0.down_proj.weight_scale").is_empty());
    }
}
