//! A DeepSpeed ZeRO checkpoint folder as one `Source`, read without torch or DeepSpeed.
//!
//! The folder is the top one (`latest` names the tag) or the tag folder itself. The tag
//! folder holds, for one model-parallel rank (`mp_rank_00`):
//! - the model states: `mp_rank_00_model_states.pt` (ZeRO-1/2) or one
//!   `zero_pp_rank_{r}_mp_rank_00_model_states.pt` per rank (ZeRO-3): `module` (the buffers,
//!   by `buffer_names`), `param_shapes` (per group, name → shape: the flat layout),
//!   `frozen_param_shapes` and `frozen_param_fragments`, `shared_params` (alias → name);
//! - per data-parallel rank, `[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`, whose
//!   `optimizer_state_dict` holds `zero_stage`, `partition_count` (the world size is its
//!   largest) and the fp32 masters:
//!   - ZeRO-1/2 `single_partition_of_fp32_groups`: per group, the ranks' partitions
//!     concatenated are the group's parameters one after another in `param_shapes` order
//!     (`param_alignment_paddings[g][i]` elements after each), the tail padded to a multiple
//!     of 2 × world;
//!   - ZeRO-3 `fp32_flat_groups`: each parameter takes `ceil(numel / world)` elements of every
//!     rank's flat vector (its groups end to end) at the same running offset; the ranks'
//!     pieces joined, cut to `numel`, are the parameter.
//!
//! Every pickle goes through the allow-listed unpickler: DeepSpeed's classes stand as inert
//! records (`ZERO_RECORDS`), nothing is imported or called. The files are mapped and only
//! the storages are located: a parameter is `Gather::Pieces` over the flat runs it takes of
//! the ranks' partitions (`Pieces::from_runs`), so converting reads those bytes and no
//! others: the Adam moments beside them are never touched.
//!
//! Names and order are `zero_to_fp32`'s (`get_fp32_state_dict_from_zero_checkpoint`):
//! buffers (in `module` order), frozen parameters, trainable ones in `param_shapes` order,
//! then the shared ones (each its own tensor, the bytes of the one it aliases). Buffers keep
//! their dtype (`zero_to_fp32` upcasts fp16/bf16 buffers to fp32; stcast converts them as
//! any tensor). `--strip-prefix` applies; `--key` does not (one state dict).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use crate::error::{DistProblem, Error, Result};
use crate::format::Format;
use crate::gather::{FlatRun, Gather, Pieces};
use crate::header::SourceTensor;
use crate::input::{torch_header, InputOptions};
use crate::source::{InputFile, Origin, Source};
use crate::torch::{self, Checkpoint, Limits, ObjId, Object, TensorDesc};

/// The classes DeepSpeed's pickles name that stand as inert records (never imported or
/// called): the ZeRO stage enum, the loss scalers, the fragment addresses of
/// `param_slice_mappings`. Any other unlisted class is a note, as in a PyTorch checkpoint.
pub const ZERO_RECORDS: &[&str] = &[
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
];

/// Names of a folder looked at (a tag folder of 10,000 ranks lists 20,000 files).
const MAX_ENTRIES: usize = 1_000_000;

/// What a file of the tag folder is, by its name.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    /// `mp_rank_{mp}_model_states.pt` (`rank: None`) or
    /// `zero_pp_rank_{rank}_mp_rank_{mp}_model_states.pt`.
    Model { rank: Option<u64>, mp: u64 },
    /// `[bf16_]zero_pp_rank_{rank}_mp_rank_{mp}_optim_states.pt`.
    Optim { rank: u64, mp: u64 },
    /// Another `*model_states.pt` / `*optim_states.pt` (pipeline layers, experts).
    Other,
}

fn number(s: &str) -> Option<u64> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

/// `{rank}_mp_rank_{mp}`.
fn rank_mp(s: &str) -> Option<(u64, u64)> {
    let (r, mp) = s.split_once("_mp_rank_")?;
    Some((number(r)?, number(mp)?))
}

fn kind(name: &str) -> Option<Kind> {
    if let Some(stem) = name.strip_suffix("_model_states.pt") {
        if let Some(mp) = stem.strip_prefix("mp_rank_").and_then(number) {
            return Some(Kind::Model { rank: None, mp });
        }
        if let Some((rank, mp)) = stem.strip_prefix("zero_pp_rank_").and_then(rank_mp) {
            return Some(Kind::Model {
                rank: Some(rank),
                mp,
            });
        }
        return Some(Kind::Other);
    }
    if let Some(stem) = name.strip_suffix("_optim_states.pt") {
        let stem = stem.strip_prefix("bf16_").unwrap_or(stem);
        if let Some((rank, mp)) = stem.strip_prefix("zero_pp_rank_").and_then(rank_mp) {
            return Some(Kind::Optim { rank, mp });
        }
        return Some(Kind::Other);
    }
    if name.ends_with("model_states.pt") || name.ends_with("optim_states.pt") {
        return Some(Kind::Other);
    }
    None
}

fn list(dir: &Path) -> Result<Vec<String>> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| Error::io(dir, "cannot list the folder", e))?;
    let mut names: Vec<String> = entries
        .take(MAX_ENTRIES)
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    Ok(names)
}

fn zero(path: &Path, tensor: Option<&str>, what: impl Into<String>) -> Error {
    Error::distributed(path, tensor, DistProblem::Zero { what: what.into() })
}

fn unsupported(path: &Path, what: impl Into<String>) -> Error {
    Error::distributed(
        path,
        None,
        DistProblem::ZeroUnsupported { what: what.into() },
    )
}

/// The tag folder of `dir`: `dir` itself when it holds model or optimizer states, else the
/// one its `latest` names.
fn tag_folder(dir: &Path) -> Result<PathBuf> {
    let names = list(dir)?;
    if names
        .iter()
        .any(|n| matches!(kind(n), Some(Kind::Model { .. } | Kind::Optim { .. })))
    {
        return Ok(dir.to_path_buf());
    }
    let latest = dir.join("latest");
    let tags = super::folder::zero_tags(dir);
    let found = if tags.is_empty() {
        String::new()
    } else {
        let named: Vec<String> = tags.iter().map(|t| format!("`{t}`")).collect();
        format!("; the tag folders here: {}", named.join(", "))
    };
    if !latest.exists() {
        let what = format!(
            "no `latest` file naming the tag folder to read{found} (convert the one meant)"
        );
        return Err(zero(&latest, None, what));
    }
    let tag = super::folder::latest_tag(dir)
        .filter(|t| !t.contains('\\'))
        .ok_or_else(|| {
            let what = format!("`latest` does not name a tag folder beside it{found}");
            zero(&latest, None, what)
        })?;
    if !dir.join(&tag).is_dir() {
        let what = format!("`latest` names the tag `{tag}`, which is not a folder here{found}");
        return Err(zero(&latest, None, what));
    }
    Ok(dir.join(tag))
}

/// The files of the tag folder, by rank.
struct Layout {
    /// `mp_rank_00_model_states.pt`, if there.
    model: Option<PathBuf>,
    /// `zero_pp_rank_{r}_mp_rank_00_model_states.pt` by rank.
    model_ranks: HashMap<u64, PathBuf>,
    /// The optimizer states by rank.
    optim: HashMap<u64, PathBuf>,
}

fn layout(tag: &Path) -> Result<Layout> {
    let mut out = Layout {
        model: None,
        model_ranks: HashMap::new(),
        optim: HashMap::new(),
    };
    for name in list(tag)? {
        let path = tag.join(&name);
        match kind(&name) {
            None => {}
            Some(Kind::Other) => {
                return Err(unsupported(
                    &path,
                    format!(
                        "`{name}` (a pipeline-parallel layer or an expert's states: another \
                         layout than zero_to_fp32 reads)"
                    ),
                ))
            }
            Some(Kind::Model { mp, .. } | Kind::Optim { mp, .. }) if mp != 0 => {
                return Err(unsupported(
                    &path,
                    format!("model parallelism (`{name}`: model-parallel rank {mp})"),
                ))
            }
            Some(Kind::Model { rank: None, .. }) => out.model = Some(path),
            Some(Kind::Model {
                rank: Some(rank), ..
            }) => {
                out.model_ranks.insert(rank, path);
            }
            Some(Kind::Optim { rank, .. }) => {
                if let Some(other) = out.optim.insert(rank, path.clone()) {
                    return Err(zero(
                        &path,
                        None,
                        format!(
                            "two optimizer-state files of rank {rank} (`{}` too)",
                            other.file_name().unwrap_or_default().to_string_lossy()
                        ),
                    ));
                }
            }
        }
    }
    Ok(out)
}

/// What the checkpoint `ck` is when it is one data-parallel rank's file of a DeepSpeed ZeRO
/// checkpoint, which holds no model on its own: an optimizer states file (a partition of
/// the flat fp32 weights), or ZeRO-3 model states (its parameters are empty placeholders).
/// Told by its content, whatever its name. ZeRO-1/2's `mp_rank_00_model_states.pt` holds
/// the whole 16-bit module: it is a model, and `None`. Whatever the key: an optimizer states
/// file's dicts are a partition of the flat weights or its moments, never a model.
pub fn rank_file(ck: &Checkpoint<'_>) -> Option<String> {
    let root = ck.pickle.root;
    if let Some(osd) = item(ck, root, "optimizer_state_dict") {
        if item(ck, osd, "zero_stage").is_some() {
            return Some(
                "one data-parallel rank's optimizer states of a DeepSpeed ZeRO checkpoint (a \
                 partition of the flat fp32 weights)"
                    .into(),
            );
        }
    }
    let groups = seq(ck, item(ck, root, "param_shapes")?)?;
    let module = pairs(ck, item(ck, root, "module")?)?;
    let placeholder = module.iter().any(|&(k, v)| {
        let Some(name) = text(ck, k) else {
            return false;
        };
        let empty = tensor(ck, v).is_ok_and(|d| d.shape.iter().product::<u64>() == 0);
        empty
            && groups.iter().any(|&g| {
                shapes(ck, g).is_some_and(|s| {
                    s.iter()
                        .any(|(n, shape)| n == name && shape.iter().product::<u64>() > 0)
                })
            })
    });
    placeholder.then(|| {
        "one data-parallel rank's model states of a DeepSpeed ZeRO-3 checkpoint (its parameters \
         are empty placeholders: the weights are partitioned over every rank's optimizer \
         states)"
            .into()
    })
}

/// The checkpoint folder a rank's file at `path` belongs to: its tag folder's parent when
/// that one's `latest` names the tag, else the tag folder.
pub fn checkpoint_folder(path: &Path) -> PathBuf {
    let tag = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    // (`.` or `..`: the real name of the folder.)
    let tag = match tag.file_name() {
        Some(_) => tag,
        None => std::fs::canonicalize(&tag).unwrap_or(tag),
    };
    let named = tag.file_name().map(|n| n.to_string_lossy().into_owned());
    if let (Some(top), Some(named)) = (tag.parent(), named) {
        let latest = super::folder::read_latest(&top.join("latest"));
        if latest.is_some_and(|t| t.trim() == named) {
            return if top.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                top.to_path_buf()
            };
        }
    }
    tag
}

// --- reading the inert pickles ---

/// The object `id` (borrowed from the pickle, or made for an inline int).
fn get<'c, 'a>(ck: &'c Checkpoint<'a>, id: ObjId) -> std::borrow::Cow<'c, Object<'a>> {
    ck.pickle.get(id)
}

/// The value of `key` in the dict `id`.
fn item(ck: &Checkpoint<'_>, id: ObjId, key: &str) -> Option<ObjId> {
    match ck.pickle.arena(id)? {
        Object::Dict(d) => d
            .items
            .iter()
            .rev()
            .find(|(k, _)| text(ck, *k) == Some(key))
            .map(|&(_, v)| v),
        _ => None,
    }
}

fn pairs<'c>(ck: &'c Checkpoint<'_>, id: ObjId) -> Option<&'c [(ObjId, ObjId)]> {
    ck.pickle.dict_items(id)
}

fn seq<'c>(ck: &'c Checkpoint<'_>, id: ObjId) -> Option<&'c [ObjId]> {
    ck.pickle.seq(id)
}

fn text<'c>(ck: &'c Checkpoint<'_>, id: ObjId) -> Option<&'c str> {
    ck.pickle.str_of(id)
}

fn int(ck: &Checkpoint<'_>, id: ObjId) -> Option<i64> {
    match &*get(ck, id) {
        Object::Int(n) => Some(*n),
        Object::Bool(b) => Some(i64::from(*b)),
        _ => None,
    }
}

fn ints(ck: &Checkpoint<'_>, id: ObjId) -> Option<Vec<u64>> {
    seq(ck, id)?
        .iter()
        .map(|&i| int(ck, i).and_then(|n| u64::try_from(n).ok()))
        .collect()
}

/// A dict of name → shape (`param_shapes[g]`, `frozen_param_shapes`).
fn shapes(ck: &Checkpoint<'_>, id: ObjId) -> Option<Vec<(String, Vec<u64>)>> {
    pairs(ck, id)?
        .iter()
        .map(|&(k, v)| Some((text(ck, k)?.to_string(), ints(ck, v)?)))
        .collect()
}

/// The tensor `id` stands for, or why it is none.
fn tensor(ck: &Checkpoint<'_>, id: ObjId) -> std::result::Result<TensorDesc, String> {
    match ck.tensor_of(id) {
        Some(Ok(d)) => Ok(d.clone()),
        Some(Err(p)) => Err(p.to_string()),
        None => Err(format!("{}, not a tensor", get(ck, id).kind())),
    }
}

/// A tensor as a flat vector: its dtype, first byte and elements (contiguous, little-endian).
#[derive(Clone, Copy, Debug)]
struct Flat {
    dtype: Dtype,
    start: u64,
    numel: u64,
}

fn flat(desc: &TensorDesc) -> std::result::Result<Flat, String> {
    match desc.contiguous_range() {
        Some(r) if !desc.big_endian => Ok(Flat {
            dtype: desc.dtype,
            start: r.start,
            numel: desc.numel(),
        }),
        _ => Err("a strided or big-endian view; stcast reads contiguous partitions".into()),
    }
}

/// What an optimizer-states file says.
struct Optim {
    stage: i64,
    world: u64,
    /// The fp32 master groups of this rank.
    groups: Vec<Flat>,
    /// ZeRO-1/2: the gap after each parameter, per group (DeepSpeed >= 0.19).
    paddings: Option<Vec<Vec<u64>>>,
}

fn read_optim(ck: &Checkpoint<'_>) -> std::result::Result<Optim, String> {
    let osd = item(ck, ck.pickle.root, "optimizer_state_dict")
        .filter(|&o| pairs(ck, o).is_some())
        .ok_or("no optimizer_state_dict dict")?;
    let stage_obj =
        item(ck, osd, "zero_stage").ok_or("no zero_stage in its optimizer_state_dict")?;
    // A ZeroStageEnum(n) (an inert record called with its value), or a plain int.
    let stage = match &*get(ck, stage_obj) {
        Object::Placeholder(p) => p
            .args
            .and_then(|a| seq(ck, a))
            .and_then(|a| a.first().copied())
            .and_then(|v| int(ck, v)),
        _ => int(ck, stage_obj),
    }
    .ok_or("its zero_stage is not a ZeroStageEnum of a stage")?;
    let world = match item(ck, osd, "partition_count") {
        Some(p) => match int(ck, p) {
            Some(n) => u64::try_from(n).ok(),
            None => ints(ck, p).and_then(|v| v.into_iter().max()),
        },
        None => None,
    }
    .filter(|&n| n > 0)
    .ok_or("no partition_count (an int or a list of them)")?;
    let key = match stage {
        1 | 2 => "single_partition_of_fp32_groups",
        3 => "fp32_flat_groups",
        n => return Err(format!("zero_stage {n}: not a ZeRO stage (1, 2 or 3)")),
    };
    let list = item(ck, osd, key)
        .and_then(|l| seq(ck, l))
        .ok_or_else(|| format!("no {key} list (ZeRO stage {stage})"))?;
    let groups = list
        .iter()
        .enumerate()
        .map(|(g, &t)| {
            tensor(ck, t)
                .and_then(|d| flat(&d))
                .map_err(|w| format!("{key}[{g}]: {w}"))
        })
        .collect::<std::result::Result<Vec<Flat>, String>>()?;
    let paddings = match item(ck, osd, "param_alignment_paddings") {
        None => None,
        Some(p) if matches!(&*get(ck, p), Object::None) => None,
        Some(p) => Some(
            seq(ck, p)
                .and_then(|gs| gs.iter().map(|&g| ints(ck, g)).collect::<Option<Vec<_>>>())
                .ok_or("its param_alignment_paddings is not a list of lists of ints")?,
        ),
    };
    Ok(Optim {
        stage,
        world,
        groups,
        paddings,
    })
}

/// What a model-states file says.
struct Model {
    /// The buffers, in `module` order.
    buffers: Vec<(String, std::result::Result<TensorDesc, String>)>,
    groups: Vec<Vec<(String, Vec<u64>)>>,
    frozen: Vec<(String, Vec<u64>)>,
    fragments: HashMap<String, std::result::Result<TensorDesc, String>>,
    /// (alias, name).
    shared: Vec<(String, String)>,
}

fn read_model(ck: &Checkpoint<'_>) -> std::result::Result<Model, String> {
    let root = ck.pickle.root;
    let names: Vec<&str> = item(ck, root, "buffer_names")
        .and_then(|b| seq(ck, b))
        .and_then(|b| b.iter().map(|&n| text(ck, n)).collect::<Option<Vec<_>>>())
        .ok_or("no buffer_names list: not a model-states file")?;
    let module = item(ck, root, "module")
        .and_then(|m| pairs(ck, m))
        .ok_or("no module dict")?;
    let mut buffers = Vec::new();
    for &(k, v) in module {
        let Some(name) = text(ck, k) else { continue };
        if names.contains(&name) {
            buffers.push((name.to_string(), tensor(ck, v)));
        }
    }
    let groups = item(ck, root, "param_shapes")
        .and_then(|p| seq(ck, p))
        .and_then(|gs| {
            gs.iter()
                .map(|&g| shapes(ck, g))
                .collect::<Option<Vec<_>>>()
        })
        .ok_or("no param_shapes list of name → shape dicts")?;
    let none = |id: Option<ObjId>| id.filter(|&i| !matches!(&*get(ck, i), Object::None));
    let frozen = match none(item(ck, root, "frozen_param_shapes")) {
        None => Vec::new(),
        Some(f) => shapes(ck, f).ok_or("its frozen_param_shapes is not a name → shape dict")?,
    };
    let fragments = match none(item(ck, root, "frozen_param_fragments")) {
        None => HashMap::new(),
        Some(f) => pairs(ck, f)
            .ok_or("its frozen_param_fragments is not a dict")?
            .iter()
            .filter_map(|&(k, v)| Some((text(ck, k)?.to_string(), tensor(ck, v))))
            .collect(),
    };
    let shared = match none(item(ck, root, "shared_params")) {
        None => Vec::new(),
        Some(s) => pairs(ck, s)
            .ok_or("its shared_params is not a dict")?
            .iter()
            .map(|&(k, v)| Some((text(ck, k)?.to_string(), text(ck, v)?.to_string())))
            .collect::<Option<Vec<_>>>()
            .ok_or("its shared_params is not a dict of names")?,
    };
    Ok(Model {
        buffers,
        groups,
        frozen,
        fragments,
        shared,
    })
}

// --- building the tensors ---

/// The output state dict as zero_to_fp32 fills it: an insertion-ordered dict (a name set
/// again keeps its place).
#[derive(Default)]
struct StateDict {
    tensors: Vec<SourceTensor>,
    index: HashMap<String, usize>,
}

impl StateDict {
    fn insert(&mut self, t: SourceTensor) {
        match self.index.get(&t.name) {
            Some(&i) => self.tensors[i] = t,
            None => {
                self.index.insert(t.name.clone(), self.tensors.len());
                self.tensors.push(t);
            }
        }
    }
}

fn usize_shape(shape: &[u64]) -> Option<Vec<usize>> {
    shape.iter().map(|&d| usize::try_from(d).ok()).collect()
}

fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
}

/// A tensor of file `input` read as a PyTorch checkpoint's (a range, or a gathered view),
/// of `shape` (a contiguous tensor may be reshaped to it: the same elements).
fn whole(
    name: &str,
    desc: &TensorDesc,
    input: usize,
    shape: &[u64],
) -> std::result::Result<SourceTensor, String> {
    let ushape = usize_shape(shape).ok_or("a size past the address space")?;
    let (start, end, gather) = match desc.contiguous_range() {
        Some(r) if !desc.big_endian => (r.start, r.end, None),
        _ if desc.shape == shape => {
            let start = desc.span().start;
            (
                start,
                start.saturating_add(desc.nbytes()),
                Some(Box::new(Gather::View(desc.clone()))),
            )
        }
        _ => return Err("a strided view of another shape".into()),
    };
    Ok(SourceTensor {
        name: name.to_string(),
        dtype: desc.dtype,
        shape: ushape,
        start,
        end,
        input,
        gather,
    })
}

/// A tensor made of flat runs.
fn pieced(
    name: &str,
    dtype: Dtype,
    shape: &[u64],
    runs: &[FlatRun],
) -> std::result::Result<SourceTensor, String> {
    let ushape = usize_shape(shape).ok_or("a size past the address space")?;
    let pieces = Pieces::from_runs(name, dtype, shape, runs).map_err(|e| e.problem.to_string())?;
    let (input, start) = pieces
        .pieces()
        .first()
        .map_or((runs.first().map_or(0, |r| r.input), 0), |q| {
            (q.input, q.bytes.start)
        });
    let end = start + pieces.nbytes();
    Ok(SourceTensor {
        name: name.to_string(),
        dtype,
        shape: ushape,
        start,
        end,
        input,
        gather: Some(Box::new(Gather::Pieces(pieces))),
    })
}

/// The runs elements `first..first + count` of a rank's vector take of its segments
/// (`segs`: (file, flat, offset of the segment in the vector)), as tensor elements from `at`.
fn runs_of(segs: &[(usize, Flat, u64)], first: u64, count: u64, at: u64, out: &mut Vec<FlatRun>) {
    let end = first + count;
    for &(input, f, off) in segs {
        let (lo, hi) = (first.max(off), end.min(off + f.numel));
        if lo < hi {
            let es = (f.dtype.bitsize() / 8) as u64;
            out.push(FlatRun {
                input,
                start: f.start + (lo - off) * es,
                first: at + (lo - first),
                count: hi - lo,
            });
        }
    }
}

/// The files opened so far (the source's, in order) and the globals their pickles name.
#[derive(Default)]
struct Reader {
    files: Vec<InputFile>,
    globals: Vec<String>,
    /// Globals outside the allow-list and `ZERO_RECORDS`.
    unlisted: Vec<String>,
}

impl Reader {
    /// Map `path` and read its pickle: the checkpoint and the file's index in the source.
    fn load<T>(
        &mut self,
        path: &Path,
        read: impl FnOnce(&Checkpoint<'_>) -> T,
    ) -> Result<(T, usize)> {
        let f = InputFile::open(path, 1, |_| {
            zero(
                path,
                None,
                "an empty file where DeepSpeed writes a torch.save archive",
            )
        })?;
        let ck = torch::read(&f.map, &Limits::default()).map_err(|error| Error::Checkpoint {
            path: path.to_path_buf(),
            error,
        })?;
        // What is read of it is owned: the pickle borrows the map, which moves below.
        for g in &ck.globals {
            if !self.globals.contains(g) {
                self.globals.push(g.clone());
            }
        }
        for g in &ck.placeholders {
            if !ZERO_RECORDS.contains(&g.as_str()) && !self.unlisted.contains(g) {
                self.unlisted.push(g.clone());
            }
        }
        let out = read(&ck);
        drop(ck);
        self.files.push(f);
        Ok((out, self.files.len() - 1))
    }

    fn path(&self, input: usize) -> &Path {
        &self.files[input].path
    }
}

/// The optimizer states of every rank, rank 0 first (it says the world size); the file of
/// rank r is the source's file r.
fn read_optims(tag: &Path, lay: &Layout, rd: &mut Reader) -> Result<Vec<Optim>> {
    let missing = |rank: u64, why: String| {
        let name = format!("zero_pp_rank_{rank}_mp_rank_00_optim_states.pt");
        zero(&tag.join(&name), None, why.replace("NAME", &name))
    };
    let mut optims: Vec<Optim> = Vec::new();
    let mut rank = 0u64;
    loop {
        let path = match lay.optim.get(&rank) {
            Some(p) => p.clone(),
            None if rank == 0 => {
                return Err(missing(
                    0,
                    "rank 0's optimizer states are missing (no `*NAME`)".into(),
                ))
            }
            None => {
                let (world, held) = (optims[0].world, lay.optim.len());
                return Err(missing(
                    rank,
                    format!(
                        "rank {rank}'s optimizer states are missing: partition_count says \
                         {world} ranks, the folder holds {held}"
                    ),
                ));
            }
        };
        let (o, _) = rd.load(&path, read_optim)?;
        let o = o.map_err(|w| zero(&path, None, w))?;
        if let Some(first) = optims.first() {
            if o.stage != first.stage || o.world != first.world {
                return Err(zero(
                    &path,
                    None,
                    format!(
                        "ZeRO stage {} of {} ranks, where rank 0's says stage {} of {}",
                        o.stage, o.world, first.stage, first.world
                    ),
                ));
            }
        }
        optims.push(o);
        rank += 1;
        if rank == optims[0].world {
            break;
        }
    }
    let world = optims[0].world;
    if let Some(extra) = lay.optim.keys().copied().filter(|&r| r >= world).min() {
        return Err(zero(
            &lay.optim[&extra],
            None,
            format!("optimizer states of rank {extra}, where partition_count says {world} ranks"),
        ));
    }
    let dtype = optims[0].groups.first().map_or(Dtype::F32, |g| g.dtype);
    for (r, o) in optims.iter().enumerate() {
        if let Some(g) = o.groups.iter().position(|g| g.dtype != dtype) {
            return Err(zero(
                rd.path(r),
                None,
                format!(
                    "its fp32 group {g} is {:?}, where rank 0's are {dtype:?}",
                    o.groups[g].dtype
                ),
            ));
        }
    }
    Ok(optims)
}

/// What the tensors are built from: the optimizer states (file r: rank r's) and rank 0's
/// model states (file `model_input`).
struct Parts<'a> {
    optims: &'a [Optim],
    world: u64,
    stage: i64,
    /// The fp32 masters' dtype (one for every group of every rank).
    dtype: Dtype,
    model: &'a Model,
    model_path: &'a Path,
    model_input: usize,
}

/// The frozen parameters: rank 0's fragments whole (ZeRO-1/2), the ranks' joined and cut
/// to their shape (ZeRO-3: every rank's model states are read).
fn frozen(
    p: &Parts<'_>,
    tag: &Path,
    lay: &Layout,
    rd: &mut Reader,
    sd: &mut StateDict,
) -> Result<()> {
    if p.model.frozen.is_empty() {
        return Ok(());
    }
    // (model states, file, path) of ranks 1.. (ZeRO-3).
    let mut ranks: Vec<(Model, usize, PathBuf)> = Vec::new();
    if p.stage == 3 {
        for r in 1..p.world {
            let name = format!("zero_pp_rank_{r}_mp_rank_00_model_states.pt");
            let path = lay.model_ranks.get(&r).cloned().ok_or_else(|| {
                zero(
                    &tag.join(&name),
                    None,
                    format!(
                        "rank {r}'s model states (`{name}`) are missing: they hold its \
                         fragments of the frozen parameters"
                    ),
                )
            })?;
            let (m, input) = rd.load(&path, read_model)?;
            let m = m.map_err(|w| zero(&path, None, w))?;
            ranks.push((m, input, path));
        }
    }
    for (name, shape) in &p.model.frozen {
        let fail = |path: &Path, what: String| zero(path, Some(name), what);
        let n = numel(shape).ok_or_else(|| fail(p.model_path, "its shape overflows".into()))?;
        let fragment = |m: &Model, path: &Path| {
            m.fragments
                .get(name)
                .ok_or_else(|| fail(path, "no frozen_param_fragments entry".into()))?
                .as_ref()
                .map_err(|w| fail(path, w.clone()))
                .cloned()
        };
        let d0 = fragment(p.model, p.model_path)?;
        let t = if p.stage <= 2 {
            if d0.numel() != n {
                let what = format!(
                    "its fragment holds {} elements, its shape {shape:?} {n}",
                    d0.numel()
                );
                return Err(fail(p.model_path, what));
            }
            whole(name, &d0, p.model_input, shape).map_err(|w| fail(p.model_path, w))?
        } else {
            let mut runs = Vec::new();
            let mut at = 0u64;
            let all = std::iter::once((p.model, p.model_input, p.model_path))
                .chain(ranks.iter().map(|(m, i, path)| (m, *i, path.as_path())));
            for (m, input, path) in all {
                let d = fragment(m, path)?;
                let f = flat(&d).map_err(|w| fail(path, w))?;
                if f.dtype != d0.dtype {
                    let what = format!("its fragment is {:?}, rank 0's {:?}", f.dtype, d0.dtype);
                    return Err(fail(path, what));
                }
                let take = f.numel.min(n - at);
                runs_of(&[(input, f, 0)], 0, take, at, &mut runs);
                at += take;
            }
            if at < n {
                let what =
                    format!("the ranks' fragments hold {at} elements, its shape {shape:?} {n}");
                return Err(fail(p.model_path, what));
            }
            pieced(name, d0.dtype, shape, &runs).map_err(|w| fail(p.model_path, w))?
        };
        sd.insert(t);
    }
    Ok(())
}

/// ZeRO-1/2: per group, the ranks' partitions end to end hold the parameters one after
/// another (each followed by its alignment padding); the tail is padded to 2 × world.
fn zero2(p: &Parts<'_>, rd: &Reader, sd: &mut StateDict) -> Result<()> {
    let ngroups = p.model.groups.len();
    for (r, o) in p.optims.iter().enumerate() {
        if o.groups.len() != ngroups {
            let what = format!(
                "{} fp32 partitions, where param_shapes has {ngroups} groups",
                o.groups.len()
            );
            return Err(zero(rd.path(r), None, what));
        }
    }
    let last = rd.path(p.optims.len() - 1);
    for (g, params) in p.model.groups.iter().enumerate() {
        // The ranks' partitions end to end: (file, flat, offset in the group).
        let mut segs = Vec::with_capacity(p.optims.len());
        let mut total = 0u64;
        for (r, o) in p.optims.iter().enumerate() {
            segs.push((r, o.groups[g], total));
            total += o.groups[g].numel;
        }
        let pads = match &p.optims[0].paddings {
            Some(all) => {
                let pads = all.get(g).cloned().unwrap_or_default();
                if pads.len() != params.len() {
                    let what = format!(
                        "param_alignment_paddings[{g}] has {} entries for the {} parameters \
                         of group {g}",
                        pads.len(),
                        params.len()
                    );
                    return Err(zero(rd.path(0), None, what));
                }
                pads
            }
            None => vec![0; params.len()],
        };
        let mut offset = 0u64;
        for ((name, shape), pad) in params.iter().zip(pads) {
            let fail = |path: &Path, what: String| zero(path, Some(name), what);
            let n = numel(shape).ok_or_else(|| fail(p.model_path, "its shape overflows".into()))?;
            let end = offset
                .checked_add(n)
                .filter(|&e| e <= total)
                .ok_or_else(|| {
                    let what = format!(
                        "its elements end at {}, past the {total} elements of group {g}'s \
                     partitions (the ranks' sizes do not add up)",
                        offset.saturating_add(n)
                    );
                    fail(last, what)
                })?;
            let mut runs = Vec::new();
            runs_of(&segs, offset, n, 0, &mut runs);
            let t = pieced(name, p.dtype, shape, &runs).map_err(|w| fail(p.model_path, w))?;
            sd.insert(t);
            offset = end.saturating_add(pad);
        }
        let align = 2 * p.world;
        let up = |x: u64| x.div_ceil(align).saturating_mul(align);
        if up(offset) != up(total) {
            let what = format!(
                "group {g}'s parameters take {offset} elements, its partitions hold {total} \
                 (rounded to {align}: {} and {}); the ranks' sizes do not add up",
                up(offset),
                up(total)
            );
            return Err(zero(rd.path(0), None, what));
        }
    }
    Ok(())
}

/// ZeRO-3: each parameter takes `ceil(numel / world)` elements of every rank's flat vector
/// (its groups end to end) at the same running offset; rank r's are its elements from
/// `r × ceil(numel / world)`, the last rank's cut to `numel`.
fn zero3(p: &Parts<'_>, rd: &Reader, sd: &mut StateDict) -> Result<()> {
    let sizes0: Vec<u64> = p.optims[0].groups.iter().map(|g| g.numel).collect();
    let per_rank: u64 = sizes0.iter().sum();
    // Per rank, its groups: (file, flat, offset in the rank's vector).
    let mut segs: Vec<Vec<(usize, Flat, u64)>> = Vec::with_capacity(p.optims.len());
    for (r, o) in p.optims.iter().enumerate() {
        let sizes: Vec<u64> = o.groups.iter().map(|g| g.numel).collect();
        if sizes != sizes0 {
            let what = format!("its fp32_flat_groups hold {sizes:?} elements, rank 0's {sizes0:?}");
            return Err(zero(rd.path(r), None, what));
        }
        let mut off = 0;
        let mut s = Vec::with_capacity(o.groups.len());
        for &f in &o.groups {
            s.push((r, f, off));
            off += f.numel;
        }
        segs.push(s);
    }
    let mut seen: HashMap<&str, ()> = HashMap::new();
    let mut offset = 0u64;
    for (name, shape) in p.model.groups.iter().flatten() {
        let fail = |path: &Path, what: String| zero(path, Some(name), what);
        if seen.insert(name, ()).is_some() {
            return Err(fail(p.model_path, "named twice in param_shapes".into()));
        }
        let n = numel(shape).ok_or_else(|| fail(p.model_path, "its shape overflows".into()))?;
        let part = n.div_ceil(p.world);
        if offset.saturating_add(part) > per_rank {
            let what = format!(
                "its partitions end at {}, past the {per_rank} elements of each rank's \
                 fp32_flat_groups",
                offset.saturating_add(part)
            );
            return Err(fail(rd.path(0), what));
        }
        let mut runs = Vec::new();
        for (r, s) in segs.iter().enumerate() {
            let at = r as u64 * part;
            if at >= n {
                break;
            }
            runs_of(s, offset, part.min(n - at), at, &mut runs);
        }
        let t = pieced(name, p.dtype, shape, &runs).map_err(|w| fail(p.model_path, w))?;
        sd.insert(t);
        offset += part;
    }
    if offset != per_rank {
        let what = format!(
            "the parameters take {offset} elements of each rank's fp32_flat_groups, which hold \
             {per_rank}; the sizes do not add up"
        );
        return Err(zero(rd.path(0), None, what));
    }
    Ok(())
}

/// Open the ZeRO checkpoint folder `dir` (the top folder or a tag folder): read the
/// pickles, lay out every parameter over the ranks' partitions; no tensor data is read.
pub fn open(dir: &Path, opts: &InputOptions) -> Result<Source> {
    if let Some(key) = &opts.key {
        return Err(Error::distributed(
            dir,
            None,
            DistProblem::ZeroKey { key: key.clone() },
        ));
    }
    let tag = tag_folder(dir)?;
    let lay = layout(&tag)?;
    let mut rd = Reader::default();
    let optims = read_optims(&tag, &lay, &mut rd)?;
    let (stage, world) = (optims[0].stage, optims[0].world);

    // Rank 0's model states (ZeRO-3: `zero_pp_rank_0_...`).
    let (model_path, name) = if stage <= 2 {
        (lay.model.clone(), "mp_rank_00_model_states.pt")
    } else {
        (
            lay.model_ranks.get(&0).cloned(),
            "zero_pp_rank_0_mp_rank_00_model_states.pt",
        )
    };
    let model_path = model_path.ok_or_else(|| {
        let what = format!("`{name}` is missing (ZeRO stage {stage})");
        zero(&tag.join(name), None, what)
    })?;
    let (model, model_input) = rd.load(&model_path, read_model)?;
    let model = model.map_err(|w| zero(&model_path, None, w))?;

    let mut sd = StateDict::default();
    for (name, desc) in &model.buffers {
        let t = desc
            .as_ref()
            .map_err(String::clone)
            .and_then(|d| whole(name, d, model_input, &d.shape))
            .map_err(|w| zero(&model_path, Some(name), w))?;
        sd.insert(t);
    }
    let parts = Parts {
        optims: &optims,
        world,
        stage,
        dtype: optims[0].groups.first().map_or(Dtype::F32, |g| g.dtype),
        model: &model,
        model_path: &model_path,
        model_input,
    };
    frozen(&parts, &tag, &lay, &mut rd, &mut sd)?;
    if stage <= 2 {
        zero2(&parts, &rd, &mut sd)?;
    } else {
        zero3(&parts, &rd, &mut sd)?;
    }
    // Shared parameters: the bytes of the one each aliases, under its own name (an alias of
    // no tensor is left out, as zero_to_fp32 does).
    for (alias, name) in &model.shared {
        if let Some(&i) = sd.index.get(name) {
            let mut t = sd.tensors[i].clone();
            t.name = alias.clone();
            sd.insert(t);
        }
    }
    let tensors = sd.tensors;

    let stored: u64 = rd.files.iter().map(|f| f.map.len() as u64).sum();
    let data: u64 = tensors.iter().map(SourceTensor::len).sum();
    let header = torch_header(stored.saturating_sub(data), tensors);
    let origin = Origin {
        format: Format::DeepSpeed,
        key: String::new(),
        skipped: Vec::new(),
        globals: rd.globals,
        unlisted: rd.unlisted,
    };
    let mut source = Source::from_parts(dir, rd.files, header);
    source.origin = Some(origin);
    Ok(source)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_told_by_their_names() {
        let cases: &[(&str, Option<Kind>)] = &[
            (
                "mp_rank_00_model_states.pt",
                Some(Kind::Model { rank: None, mp: 0 }),
            ),
            (
                "zero_pp_rank_12_mp_rank_00_model_states.pt",
                Some(Kind::Model {
                    rank: Some(12),
                    mp: 0,
                }),
            ),
            (
                "zero_pp_rank_3_mp_rank_01_optim_states.pt",
                Some(Kind::Optim { rank: 3, mp: 1 }),
            ),
            (
                "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                Some(Kind::Optim { rank: 0, mp: 0 }),
            ),
            ("layer_01-model_states.pt", Some(Kind::Other)),
            ("expp_rank_0_mp_rank_00_optim_states.pt", Some(Kind::Other)),
            (
                "zero_pp_rank_x_mp_rank_00_optim_states.pt",
                Some(Kind::Other),
            ),
            ("zero_to_fp32.py", None),
            ("latest", None),
        ];
        for (name, want) in cases {
            assert_eq!(kind(name), *want, "{name}");
        }
    }

    #[test]
    fn a_rank_vector_splits_into_runs_at_its_group_boundaries() {
        let f = |start, numel| Flat {
            dtype: Dtype::F32,
            start,
            numel,
        };
        // Groups of 5 and 4 elements, in files 3 and 4 (bytes 100.., 200..).
        let segs = [(3, f(100, 5), 0), (4, f(200, 4), 5)];
        let mut runs = Vec::new();
        runs_of(&segs, 3, 4, 10, &mut runs);
        assert_eq!(
            runs,
            [
                FlatRun {
                    input: 3,
                    start: 112,
                    first: 10,
                    count: 2
                },
                FlatRun {
                    input: 4,
                    start: 200,
                    first: 12,
                    count: 2
                },
            ]
        );
        runs.clear();
        runs_of(&segs, 9, 0, 0, &mut runs);
        assert!(runs.is_empty());
    }
}
