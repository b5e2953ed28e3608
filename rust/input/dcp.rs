//! A `torch.distributed.checkpoint` (DCP) folder as one `Source`, read without torch.
//!
//! The folder holds `.metadata`, a plain `pickle.dump` of a `Metadata`, and the ranks'
//! `__{rank}_{n}.distcp` files. `.metadata` is read by the allow-listed unpickler: its
//! classes stand as inert records (`DCP_RECORDS`), nothing is imported or called.
//! - `state_dict_metadata`: fqn → `TensorStorageMetadata(properties, size, chunks)` (each
//!   chunk a box: `offsets`, `sizes`) or `BytesStorageMetadata` (a pickled object: skipped);
//! - `storage_data`: `MetadataIndex(fqn, offset)` → `_StorageInfo(relative_path, offset,
//!   length[, transform_descriptors])`: where each chunk's item is;
//! - `planner_data`: fqn → the key path in the saved state dict (`("model", "w")`).
//!
//! Each tensor item is a whole `torch.save(tensor)` zip archive at `offset` of its file,
//! `length` bytes long, read in place by the PyTorch reader. A tensor of the output is its
//! chunks' items gathered window by window (`gather::Pieces`): nothing but the items of the
//! selected tensors is read, and optimizer states beside them are never touched.
//!
//! Names are torch's: the `planner_data` path below the selected key, joined with dots, as
//! `dcp_to_torch_save` then `torch.load(...)[key]` gives them (flattened as stcast flattens
//! any nested dict).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{DistProblem, Error, Result};
use crate::format::Format;
use crate::gather::{Gather, Piece, Pieces};
use crate::header::{SourceHeader, SourceTensor};
use crate::input::{torch_header, InputOptions};
use crate::source::{InputFile, Origin, Source};
use crate::torch::pickle::{unpickle, NoStorages, Objects, StorageRef, Storages};
use crate::torch::{self, Limits, ObjId, Object, Pickle, TorchError};

/// The classes a `.metadata` pickle names that stand as inert records (never imported or
/// called): DCP's own dataclasses, the enum of memory formats, the path of the checkpoint
/// (`StorageMeta.checkpoint_id`) and the layouts. Any other class is a note, as in a
/// PyTorch checkpoint.
pub const DCP_RECORDS: &[&str] = &[
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.serialization._get_layout",
    "torch.strided",
    "torch.sparse_coo",
    "torch.contiguous_format",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
    "pathlib.WindowsPath",
    "pathlib.PureWindowsPath",
    "pathlib.Path",
];

/// The name of the metadata file in a DCP folder.
pub const METADATA: &str = ".metadata";

/// The `__metadata__` key of the safetensors shards `HuggingFaceStorageWriter` writes:
/// a JSON object, `{fqn: {"saved_offsets": [...]}}`, where this file's chunks start.
pub const SHARDING_INFO: &str = "DCP_SHARDING_INFO";

/// The other `__metadata__` key those shards carry, left out of the output with it.
const DCP_VERSION: &str = "DCP_VERSION";

/// One tensor of the checkpoint as `.metadata` describes it.
struct Entry {
    fqn: String,
    /// The key path in the saved state dict.
    path: Vec<String>,
    /// `None`: a bytes item (a pickled object), not a tensor.
    tensor: Option<TensorMeta>,
}

struct TensorMeta {
    dtype: &'static torch::dtype::TorchDtype,
    size: Vec<u64>,
    /// Each chunk's box: (offsets, sizes).
    chunks: Vec<(Vec<u64>, Vec<u64>)>,
}

/// Where one chunk's item is.
struct Item {
    file: String,
    offset: u64,
    length: u64,
    transforms: Vec<String>,
}

/// The parsed `.metadata`.
struct Metadata {
    entries: Vec<Entry>,
    /// (fqn, chunk offsets) → the item.
    items: HashMap<(String, Vec<u64>), Item>,
    /// Every global the pickle names, and those outside the allow-list.
    globals: Vec<String>,
    placeholders: Vec<String>,
}

/// Open the DCP folder `dir`: read `.metadata`, select the tensors (`opts`), and locate
/// every chunk of them in its item; no tensor data is read.
pub fn open(dir: &Path, opts: &InputOptions) -> Result<Source> {
    let meta_path = dir.join(METADATA);
    if !meta_path.exists() {
        let what = "no .metadata beside the rank files (dcp.save writes it last: the save did \
                    not finish, or the folder is not all there)";
        return Err(Error::distributed(&meta_path, None, meta_problem(what)));
    }
    let meta_file = InputFile::open(&meta_path, 1, |_| {
        Error::distributed(&meta_path, None, meta_problem("an empty file"))
    })?;
    // With a key, the entries outside it are dropped as they are parsed: an optimizer's
    // hundreds of thousands of chunks beside a small model cost nothing kept.
    let key = opts.key.as_deref().filter(|k| !k.is_empty());
    let meta = read_metadata_file(&meta_file, key)?;
    let selected = match select(&meta.entries, opts) {
        // No entry under the key: the candidates are among those dropped.
        Err(TorchError::KeyNotFound { .. }) if key.is_some() => {
            let whole = read_metadata_file(&meta_file, None)?;
            let error = match select(&whole.entries, opts) {
                Err(e) => e,
                Ok(_) => TorchError::KeyNotFound {
                    key: key.unwrap_or_default().to_string(),
                    candidates: candidates(&whole.entries, 0),
                },
            };
            Err(error)
        }
        other => other,
    };
    // Kept among the source's files (after the ranks'): a DST that is it is refused as the
    // input, and a change to it while converting is seen. Its parsed pages go.
    meta_file.unmap((0, meta_file.map.len() as u64));

    let (key, chosen, skipped) = selected.map_err(|error| Error::Checkpoint {
        path: meta_path.clone(),
        error,
    })?;

    let mut files: Vec<InputFile> = Vec::new();
    let mut file_index: HashMap<String, usize> = HashMap::new();
    let mut tensors: Vec<SourceTensor> = Vec::with_capacity(chosen.len());
    let mut item_bytes = 0u64;
    for (name, e) in chosen {
        let t = e.tensor.as_ref().expect("selected entries are tensors");
        let fail = |path: &Path, problem| Error::distributed(path, Some(&name), problem);
        let dtype = t.dtype.safetensors.ok_or_else(|| {
            fail(
                &meta_path,
                DistProblem::Metadata {
                    what: format!("its dtype {} has no safetensors dtype", t.dtype.name),
                },
            )
        })?;
        let mut pieces = Vec::with_capacity(t.chunks.len());
        let mut whole: Option<(usize, torch::TensorDesc)> = None;
        for (offsets, sizes) in &t.chunks {
            let item = meta
                .items
                .get(&(e.fqn.clone(), offsets.clone()))
                .ok_or_else(|| {
                    fail(
                        &meta_path,
                        meta_problem(&format!(
                            "no storage_data entry for its chunk at {offsets:?}"
                        )),
                    )
                })?;
            if !item.transforms.is_empty() {
                return Err(fail(
                    &meta_path,
                    DistProblem::Transformed {
                        descriptors: item.transforms.clone(),
                    },
                ));
            }
            let input = match file_index.get(&item.file) {
                Some(&i) => i,
                None => {
                    let path = item_path(dir, &item.file).map_err(|reason| {
                        fail(
                            &meta_path,
                            DistProblem::ItemFile {
                                file: item.file.clone(),
                                reason,
                            },
                        )
                    })?;
                    let f = InputFile::open(&path, 0, |_| unreachable_small(&path))?;
                    files.push(f);
                    file_index.insert(item.file.clone(), files.len() - 1);
                    files.len() - 1
                }
            };
            let f = &files[input];
            let located = locate_item(&f.map, item, dtype, sizes)
                .map_err(|problem| fail(&f.path, problem))?;
            // Parsing the item's archive mapped its records' pages (a 2 MiB page each on a
            // huge-page mount): none stays mapped for the hundreds of items of a checkpoint.
            f.unmap((item.offset, item.offset.saturating_add(item.length)));
            item_bytes += item.length;
            let bytes = match located {
                Located::Run(bytes) => bytes,
                // The whole tensor in one strided item: gathered as a PyTorch view is.
                Located::View(view) if t.chunks.len() == 1 && sizes == &t.size => {
                    whole = Some((input, view));
                    continue;
                }
                Located::View(_) => {
                    let reason = "a strided view, one chunk of several; stcast reads those \
                                  contiguous"
                        .to_string();
                    let problem = DistProblem::Item {
                        file: item.file.clone(),
                        offset: item.offset,
                        reason,
                    };
                    return Err(fail(&files[input].path, problem));
                }
            };
            pieces.push(Piece {
                input,
                bytes,
                offsets: offsets.clone(),
                sizes: sizes.clone(),
            });
        }
        let shape = t
            .size
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|_| fail(&meta_path, meta_problem("a size past the address space")))?;
        if let Some((input, view)) = whole {
            let start = view.span().start;
            let end = start
                .checked_add(view.nbytes())
                .ok_or_else(|| fail(&meta_path, meta_problem("a size past the address space")))?;
            tensors.push(SourceTensor {
                name,
                dtype,
                shape,
                start,
                end,
                input,
                gather: Some(Box::new(Gather::View(view))),
            });
            continue;
        }
        let pieces = Pieces::new(&name, dtype, &t.size, pieces).map_err(|e| {
            fail(
                &meta_path,
                DistProblem::Chunks {
                    reason: e.problem.to_string(),
                },
            )
        })?;
        // Where its elements begin: the first piece's first byte.
        let (input, start) = pieces
            .pieces()
            .first()
            .map_or((files.len().saturating_sub(1), 0), |q| {
                (q.input, q.bytes.start)
            });
        let len = pieces.nbytes();
        tensors.push(SourceTensor {
            name,
            dtype,
            shape,
            start,
            end: start + len,
            input,
            gather: Some(Box::new(Gather::Pieces(pieces))),
        });
    }
    // Read order: file by file, front to back.
    tensors.sort_by_key(|t| (t.input, t.start));
    let stored: u64 = files.iter().map(|f| f.map.len() as u64).sum();
    let header = torch_header(stored.saturating_sub(item_bytes), tensors);
    let unlisted: Vec<String> = meta
        .placeholders
        .iter()
        .filter(|g| !DCP_RECORDS.contains(&g.as_str()))
        .cloned()
        .collect();
    let origin = Origin {
        format: Format::Dcp,
        key,
        skipped,
        globals: meta.globals.clone(),
        unlisted,
    };
    files.push(meta_file);
    let mut source = Source::from_parts(dir, files, header);
    source.origin = Some(origin);
    Ok(source)
}

/// Read `.metadata`; with `key`, only the entries whose names start with it and a dot are
/// kept (a name is its `planner_data` path joined with dots, as `dcp.save` makes it; the
/// entries under the key are then chosen by their paths, as without one). Each entry kept
/// is read into a compact record as it is parsed, and its objects go.
fn read_metadata_file(meta_file: &InputFile, key: Option<&str>) -> Result<Metadata> {
    let path = &meta_file.path;
    let limits = Limits {
        inert_paths: true,
        ..Limits::default()
    };
    let mut hooks = Reading {
        prefix: key.map(|k| format!("{k}.")),
        records: Records::default(),
        file: meta_file,
    };
    let pickle =
        unpickle(&meta_file.map, "the .metadata pickle", &limits, &mut hooks).map_err(|error| {
            Error::Checkpoint {
                path: path.clone(),
                error,
            }
        })?;
    // Read again whole (a dropped object was reached again): the records of the first
    // pass are not the pickle's.
    let records = if pickle.pruned {
        hooks.records
    } else {
        Records::default()
    };
    read_metadata(&pickle, records)
        .map_err(|what| Error::distributed(path, None, DistProblem::Metadata { what }))
}

/// The unpickler's hooks for `.metadata`: the entries of `state_dict_metadata`,
/// `planner_data` and `storage_data` whose names do not start with `prefix` are dropped as
/// they are parsed (never read, so never checked); the others are read into `records`
/// and dropped too.
struct Reading<'f> {
    prefix: Option<String>,
    records: Records,
    /// `.metadata`, mapped: the pages the unpickler is done with go as it goes.
    file: &'f InputFile,
}

impl Reading<'_> {
    fn selects(&self, o: Objects<'_, '_>, fqn: ObjId) -> bool {
        match (&self.prefix, o.str_of(fqn)) {
            (Some(prefix), Some(f)) => f.starts_with(prefix.as_str()),
            _ => true,
        }
    }
}

fn part_of(o: Objects<'_, '_>, parent: ObjId) -> Option<Part> {
    match o.str_of(parent)? {
        "state_dict_metadata" => Some(Part::StateDict),
        "planner_data" => Some(Part::Planner),
        "storage_data" => Some(Part::Storage),
        _ => None,
    }
}

impl Storages for Reading<'_> {
    fn load(
        &mut self,
        objects: Objects<'_, '_>,
        pid: ObjId,
    ) -> std::result::Result<StorageRef, TorchError> {
        NoStorages.load(objects, pid)
    }

    fn prunes(&self) -> bool {
        true
    }

    fn release(&mut self, bytes: &[u8]) {
        let base = self.file.map.as_ptr() as usize;
        let a = (bytes.as_ptr() as usize).saturating_sub(base) as u64;
        self.file.unmap((a, a + bytes.len() as u64));
    }

    fn skips_value(&mut self, o: Objects<'_, '_>, parent: ObjId, key: ObjId, first: ObjId) -> bool {
        let record = matches!(o.arena(first), Some(Object::Placeholder(p))
            if !p.called && p.global.ends_with("StorageMetadata"));
        record
            && part_of(o, parent) == Some(Part::StateDict)
            && o.str_of(key).is_some()
            && !self.selects(o, key)
    }

    fn keeps_item(&mut self, o: Objects<'_, '_>, parent: ObjId, key: ObjId, value: ObjId) -> bool {
        let Some(part) = part_of(o, parent) else {
            return true;
        };
        let fqn = match part {
            Part::StateDict | Part::Planner => Some(key),
            Part::Storage => field(o, key, "fqn"),
        };
        if fqn.is_none_or(|f| self.selects(o, f)) {
            self.records.add(o, part, key, value);
        }
        false
    }
}

fn unreachable_small(path: &Path) -> Error {
    Error::distributed(path, None, meta_problem("an empty file"))
}

fn meta_problem(what: &str) -> DistProblem {
    DistProblem::Metadata {
        what: what.to_string(),
    }
}

/// The item file `name` inside `dir`: a plain file name, as DCP writes them.
fn item_path(dir: &Path, name: &str) -> std::result::Result<PathBuf, String> {
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\\', '\0']) {
        return Err("not a file name inside the checkpoint folder".into());
    }
    Ok(dir.join(name))
}

/// The byte range (in the file) of the tensor data of the item `item`: a `torch.save` zip
/// of one contiguous little-endian tensor of `dtype` and `sizes`.
fn locate_item(
    map: &[u8],
    item: &Item,
    dtype: safetensors::Dtype,
    sizes: &[u64],
) -> std::result::Result<Located, DistProblem> {
    let len = map.len() as u64;
    let end = item.offset.saturating_add(item.length);
    if end > len {
        return Err(DistProblem::PastEnd {
            file: item.file.clone(),
            end,
            len,
        });
    }
    let bad = |reason: String| DistProblem::Item {
        file: item.file.clone(),
        offset: item.offset,
        reason,
    };
    let bytes = &map[item.offset as usize..end as usize];
    let ck = torch::read(bytes, &Limits::default()).map_err(|e| bad(e.to_string()))?;
    let desc = match ck.tensor_of(ck.pickle.root) {
        Some(Ok(d)) => d,
        Some(Err(p)) => return Err(bad(p.to_string())),
        None => {
            return Err(bad(format!(
                "{}, not a tensor",
                ck.pickle.get(ck.pickle.root).kind()
            )))
        }
    };
    if desc.dtype != dtype {
        return Err(bad(format!(
            "a {:?} tensor, where the metadata says {dtype:?}",
            desc.dtype
        )));
    }
    if desc.shape != sizes {
        return Err(bad(format!(
            "a tensor of shape {:?}, where the chunk is {sizes:?}",
            desc.shape
        )));
    }
    match desc.contiguous_range() {
        Some(r) if !desc.big_endian => Ok(Located::Run(item.offset + r.start..item.offset + r.end)),
        // A transposed or permuted tensor over its whole storage: DCP saves it as it is.
        _ => {
            let mut view = desc.clone();
            view.data_start += item.offset;
            Ok(Located::View(view))
        }
    }
}

/// Where a chunk's elements are in its file.
enum Located {
    /// One row-major little-endian run of bytes.
    Run(std::ops::Range<u64>),
    /// A strided (or big-endian) view of the item's storage, offsets in the file.
    View(torch::TensorDesc),
}

// --- reading the inert records of `.metadata` ---

fn state_dict<'p>(p: Objects<'p, '_>, id: ObjId) -> Option<&'p [(ObjId, ObjId)]> {
    let state = match p.arena(id)? {
        Object::Placeholder(ph) => ph.state?,
        _ => return None,
    };
    p.dict_items(state)
}

fn field(p: Objects<'_, '_>, id: ObjId, name: &str) -> Option<ObjId> {
    state_dict(p, id)?
        .iter()
        .rev()
        .find(|(k, _)| p.str_of(*k) == Some(name))
        .map(|&(_, v)| v)
}

fn class_of<'p>(p: Objects<'p, '_>, id: ObjId) -> Option<&'p str> {
    match p.arena(id)? {
        Object::Placeholder(ph) => Some(ph.global.as_str()),
        _ => None,
    }
}

/// The entries of `.metadata` as they are read, item by item: compact, owned records (the
/// pickle's objects of an item go once it is read).
#[derive(Default)]
struct Records {
    /// state_dict_metadata, in order: (fqn, tensor or `None` for a bytes item).
    sdm: Vec<(String, Option<TensorMeta>)>,
    planner: HashMap<String, Vec<String>>,
    items: HashMap<(String, Vec<u64>), Item>,
    /// The first entry that is not what DCP writes.
    error: Option<String>,
}

/// Which of `.metadata`'s dicts an item is set in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    StateDict,
    Planner,
    Storage,
}

impl Records {
    /// Read the item `k: v` of `part` into the records.
    fn add(&mut self, p: Objects<'_, '_>, part: Part, k: ObjId, v: ObjId) {
        let read = match part {
            Part::StateDict => sdm_entry(p, k, v).map(|e| self.sdm.push(e)),
            Part::Planner => {
                if let Some((fqn, path)) = planner_entry(p, k, v) {
                    self.planner.insert(fqn, path);
                }
                Ok(())
            }
            Part::Storage => storage_entry(p, k, v).map(|(key, item)| {
                self.items.insert(key, item);
            }),
        };
        if let Err(what) = read {
            self.error.get_or_insert(what);
        }
    }
}

fn sdm_entry(
    p: Objects<'_, '_>,
    k: ObjId,
    v: ObjId,
) -> std::result::Result<(String, Option<TensorMeta>), String> {
    let fqn = p
        .str_of(k)
        .ok_or("a state_dict_metadata key that is not a str")?;
    let class = class_of(p, v).unwrap_or("");
    let tensor = if class.ends_with(".BytesStorageMetadata") {
        None
    } else if class.ends_with(".TensorStorageMetadata") {
        Some(tensor_meta(p, v).map_err(|w| format!("`{fqn}`: {w}"))?)
    } else {
        return Err(format!(
            "`{fqn}` is {}, not a storage metadata",
            p.get(v).kind()
        ));
    };
    Ok((fqn.to_string(), tensor))
}

fn planner_entry(p: Objects<'_, '_>, k: ObjId, v: ObjId) -> Option<(String, Vec<String>)> {
    let path = match p.arena(v)? {
        Object::Tuple(t) => t
            .iter()
            .map(|&i| {
                p.str_of(i)
                    .map(str::to_string)
                    .or_else(|| p.int(i).map(|n| n.to_string()))
            })
            .collect::<Option<Vec<String>>>()?,
        _ => return None,
    };
    Some((p.str_of(k)?.to_string(), path))
}

fn storage_entry(
    p: Objects<'_, '_>,
    k: ObjId,
    v: ObjId,
) -> std::result::Result<((String, Vec<u64>), Item), String> {
    let fqn = field(p, k, "fqn")
        .and_then(|f| p.str_of(f))
        .ok_or("a storage_data key without an fqn")?;
    let offsets = match field(p, k, "offset") {
        Some(o) if matches!(&*p.get(o), Object::None) => Vec::new(),
        Some(o) => p
            .sizes(o)
            .ok_or("a storage_data key whose offset is not a size")?,
        None => Vec::new(),
    };
    let file = field(p, v, "relative_path")
        .and_then(|f| p.str_of(f))
        .ok_or_else(|| format!("`{fqn}`: a storage entry without a relative_path"))?;
    let number = |name: &str| {
        field(p, v, name)
            .and_then(|i| p.int(i))
            .and_then(|n| u64::try_from(n).ok())
    };
    let (Some(offset), Some(length)) = (number("offset"), number("length")) else {
        return Err(format!(
            "`{fqn}`: a storage entry without an offset and a length"
        ));
    };
    let names = |l: &[ObjId]| -> Vec<String> {
        l.iter()
            .map(|&i| p.str_of(i).unwrap_or("?").to_string())
            .collect()
    };
    let transforms = match field(p, v, "transform_descriptors") {
        None => Vec::new(),
        Some(t) => match &*p.get(t) {
            Object::None => Vec::new(),
            Object::List(l) => names(l),
            Object::Tuple(l) => names(l),
            _ => vec!["?".to_string()],
        },
    };
    let item = Item {
        file: file.to_string(),
        offset,
        length,
        transforms,
    };
    Ok(((fqn.to_string(), offsets), item))
}

/// The parsed `.metadata`: `records` read as the pickle was parsed, then the items left in
/// its dicts (all of them when no hook read any).
fn read_metadata(
    pickle: &Pickle<'_>,
    mut records: Records,
) -> std::result::Result<Metadata, String> {
    let p = pickle.view();
    let root = pickle.root;
    if !class_of(p, root).is_some_and(|c| c.ends_with(".Metadata")) {
        return Err(format!(
            "its object is {}, not a Metadata",
            p.get(root).kind()
        ));
    }
    let sdm = field(p, root, "state_dict_metadata")
        .and_then(|d| p.dict_items(d))
        .ok_or("no state_dict_metadata dict")?;
    let sd = field(p, root, "storage_data")
        .and_then(|d| p.dict_items(d))
        .ok_or("no storage_data dict")?;
    let planner = field(p, root, "planner_data")
        .and_then(|d| p.dict_items(d))
        .unwrap_or(&[]);
    for (part, items) in [
        (Part::Planner, planner),
        (Part::StateDict, sdm),
        (Part::Storage, sd),
    ] {
        for &(k, v) in items {
            records.add(p, part, k, v);
        }
    }
    if let Some(what) = records.error {
        return Err(what);
    }
    let mut entries = Vec::with_capacity(records.sdm.len());
    for (fqn, tensor) in records.sdm {
        let path = records
            .planner
            .get(&fqn)
            .cloned()
            .unwrap_or_else(|| vec![fqn.clone()]);
        if path.is_empty() {
            return Err(format!("`{fqn}` has an empty planner_data path"));
        }
        entries.push(Entry { fqn, path, tensor });
    }
    Ok(Metadata {
        entries,
        items: records.items,
        globals: pickle.globals.clone(),
        placeholders: pickle.placeholders.clone(),
    })
}

fn tensor_meta(p: Objects<'_, '_>, id: ObjId) -> std::result::Result<TensorMeta, String> {
    let props = field(p, id, "properties").ok_or("no properties")?;
    // TensorProperties pickles its state as a tuple: (dtype, layout, requires_grad,
    // memory format, pin_memory[, strides]); older releases as a dict.
    let dtype_obj = match p.arena(props) {
        Some(Object::Placeholder(ph)) => match ph.state.and_then(|s| p.arena(s)) {
            Some(Object::Tuple(t)) => t.first().copied(),
            Some(Object::Dict(_)) => field(p, props, "dtype"),
            _ => None,
        },
        _ => None,
    }
    .ok_or("properties without a dtype")?;
    let dtype = match &*p.get(dtype_obj) {
        Object::Global(torch::Global::Dtype(t)) => *t,
        other => return Err(format!("its dtype is {}", other.kind())),
    };
    let size = field(p, id, "size")
        .and_then(|s| p.sizes(s))
        .ok_or("no size")?;
    let chunk_list: &[ObjId] = match field(p, id, "chunks").and_then(|c| p.arena(c)) {
        Some(Object::List(l)) => l,
        _ => return Err("no chunks list".into()),
    };
    let mut chunks = Vec::with_capacity(chunk_list.len());
    for &c in chunk_list {
        let offsets = field(p, c, "offsets").and_then(|o| p.sizes(o));
        let sizes = field(p, c, "sizes").and_then(|o| p.sizes(o));
        match (offsets, sizes) {
            (Some(o), Some(s)) => chunks.push((o, s)),
            _ => return Err("a chunk without offsets and sizes".into()),
        }
    }
    Ok(TensorMeta {
        dtype,
        size,
        chunks,
    })
}

type Chosen<'m> = Vec<(String, &'m Entry)>;

/// Select the tensors under `opts.key` (a dotted prefix of their key paths; without one,
/// the only group of tensors, descending through single candidates, as for a nested
/// pickle) and name them by the rest of their path.
/// Returns the key chosen, the tensors with their names, and the entries left out below
/// the key (bytes items).
fn select<'m>(
    entries: &'m [Entry],
    opts: &InputOptions,
) -> std::result::Result<(String, Chosen<'m>, Vec<String>), TorchError> {
    // (entry, index in its path where the name starts)
    let mut below: Vec<(&Entry, usize)> = Vec::new();
    let key = match opts.key.as_deref() {
        Some(key) => {
            for e in entries {
                if let Some(at) = prefix_len(&e.path, key) {
                    below.push((e, at));
                }
            }
            if below.iter().all(|(e, _)| e.tensor.is_none()) {
                return Err(TorchError::KeyNotFound {
                    key: key.to_string(),
                    candidates: candidates(entries, 0),
                });
            }
            key.to_string()
        }
        None => {
            let mut at = 0;
            let tensors: Vec<&Entry> = entries.iter().filter(|e| e.tensor.is_some()).collect();
            loop {
                let groups = candidates_of(&tensors, at);
                let top_level = tensors.iter().any(|e| e.path.len() == at + 1);
                if groups.len() == 1 && !top_level {
                    at += 1;
                    continue;
                }
                if groups.len() > 1 && !top_level {
                    return Err(TorchError::Ambiguous {
                        candidates: groups.into_iter().map(|(g, n)| (g.join("."), n)).collect(),
                    });
                }
                break;
            }
            let prefix: Vec<String> = tensors
                .first()
                .map(|e| e.path[..at.min(e.path.len())].to_vec())
                .unwrap_or_default();
            for e in entries {
                if e.path.len() > at && e.path[..at] == prefix[..] {
                    below.push((e, at));
                }
            }
            prefix.join(".")
        }
    };
    let mut chosen = Vec::new();
    let mut skipped = Vec::new();
    let mut names: HashMap<String, String> = HashMap::new();
    for (e, at) in below {
        let source = e.path[at..].join(".");
        if e.tensor.is_none() {
            skipped.push(source);
            continue;
        }
        let name = source;
        if let Some(first) = names.get(&name) {
            return Err(TorchError::DuplicateName {
                name,
                first: first.clone(),
                second: e.fqn.clone(),
            });
        }
        names.insert(name.clone(), e.fqn.clone());
        chosen.push((name, e));
    }
    Ok((key, chosen, skipped))
}

/// How many components of `path` the dotted `key` spans, if it is a prefix of it.
fn prefix_len(path: &[String], key: &str) -> Option<usize> {
    if key.is_empty() {
        return Some(0);
    }
    let mut joined = String::new();
    for (i, part) in path.iter().enumerate().take(path.len().saturating_sub(1)) {
        if i > 0 {
            joined.push('.');
        }
        joined.push_str(part);
        if joined == key {
            return Some(i + 1);
        }
        if !key.starts_with(&joined) {
            return None;
        }
    }
    None
}

/// The groups of tensors at depth `at` of their paths, with counts, in first-seen order.
fn candidates_of(tensors: &[&Entry], at: usize) -> Vec<(Vec<String>, usize)> {
    let mut groups: Vec<(Vec<String>, usize)> = Vec::new();
    for e in tensors {
        if e.path.len() <= at + 1 {
            continue;
        }
        let g = &e.path[..=at];
        match groups.iter_mut().find(|(x, _)| x == g) {
            Some((_, n)) => *n += 1,
            None => groups.push((g.to_vec(), 1)),
        }
    }
    groups
}

fn candidates(entries: &[Entry], at: usize) -> Vec<(String, usize)> {
    let tensors: Vec<&Entry> = entries.iter().filter(|e| e.tensor.is_some()).collect();
    candidates_of(&tensors, at)
        .into_iter()
        .map(|(g, n)| (g.join("."), n))
        .collect()
}

/// Open a folder of safetensors shards written by DCP's `HuggingFaceStorageWriter` (a
/// distributed save: each file holds its rank's chunks, placed by `DCP_SHARDING_INFO`, and
/// there is no `.metadata`) as one source: each tensor's size is where its chunks end, as
/// `HuggingFaceStorageReader` computes it, and it is gathered from them.
pub fn open_sharded_safetensors(dir: &Path, names: &[String]) -> Result<Source> {
    let mut files: Vec<InputFile> = Vec::with_capacity(names.len());
    // name -> (dtype, pieces), in order of first appearance.
    let mut order: Vec<String> = Vec::new();
    let mut found: HashMap<String, (safetensors::Dtype, Vec<Piece>)> = HashMap::new();
    let mut metadata: Option<Vec<(String, String)>> = None;
    for name in names {
        let path = dir.join(name);
        let source = Source::open(&path)?;
        let header = source.header;
        let file = source
            .files
            .into_iter()
            .next()
            .expect("a safetensors source has a file");
        let meta = header.metadata.clone().unwrap_or_default();
        let info = meta
            .iter()
            .find(|(k, _)| k == SHARDING_INFO)
            .map(|(_, v)| v.as_str())
            .ok_or_else(|| {
                let what = format!(
                    "no {SHARDING_INFO} in its __metadata__, beside the shards: move it out"
                );
                Error::distributed(&path, None, DistProblem::Shard { what })
            })?;
        let info: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(info).map_err(|e| {
                let what = format!("its {SHARDING_INFO} is not a JSON object: {e}");
                Error::distributed(&path, None, DistProblem::Shard { what })
            })?;
        if metadata.is_none() {
            let kept: Vec<(String, String)> = meta
                .into_iter()
                .filter(|(k, _)| k != SHARDING_INFO && k != DCP_VERSION)
                .collect();
            metadata = Some(kept);
        }
        let input = files.len();
        for t in &header.tensors {
            let offsets: Option<Vec<u64>> = info
                .get(&t.name)
                .and_then(|v| v.get("saved_offsets"))
                .and_then(|v| v.as_array())
                .and_then(|a| a.iter().map(|x| x.as_u64()).collect());
            let offsets = offsets.ok_or_else(|| {
                Error::distributed(
                    &path,
                    Some(&t.name),
                    DistProblem::Shard {
                        what: format!("no saved_offsets of whole numbers in {SHARDING_INFO}"),
                    },
                )
            })?;
            let sizes: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
            let piece = Piece {
                input,
                bytes: file.base + t.start..file.base + t.end,
                offsets,
                sizes,
            };
            match found.get_mut(&t.name) {
                Some((dtype, pieces)) => {
                    if *dtype != t.dtype {
                        return Err(Error::distributed(
                            &path,
                            Some(&t.name),
                            DistProblem::Chunks {
                                reason: format!(
                                    "disagree on the dtype: {dtype:?} in one file, {:?} here",
                                    t.dtype
                                ),
                            },
                        ));
                    }
                    pieces.push(piece);
                }
                None => {
                    order.push(t.name.clone());
                    found.insert(t.name.clone(), (t.dtype, vec![piece]));
                }
            }
        }
        files.push(file);
    }
    let mut tensors = Vec::with_capacity(order.len());
    for name in order {
        let (dtype, pieces) = found.remove(&name).expect("every name was found");
        let rank = pieces[0].offsets.len();
        let mut size = vec![0u64; rank];
        for q in &pieces {
            if q.offsets.len() != rank || q.sizes.len() != rank {
                return Err(Error::distributed(
                    dir,
                    Some(&name),
                    DistProblem::Chunks {
                        reason: "disagree on the number of dimensions".into(),
                    },
                ));
            }
            for (d, (o, n)) in q.offsets.iter().zip(&q.sizes).enumerate() {
                size[d] = size[d].max(o.saturating_add(*n));
            }
        }
        let pieces = Pieces::new(&name, dtype, &size, pieces).map_err(|e| {
            Error::distributed(
                dir,
                Some(&name),
                DistProblem::Chunks {
                    reason: e.problem.to_string(),
                },
            )
        })?;
        let shape = size
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|_| {
                Error::distributed(
                    dir,
                    Some(&name),
                    meta_problem("a size past the address space"),
                )
            })?;
        let (input, start) = pieces
            .pieces()
            .first()
            .map_or((0, 0), |q| (q.input, q.bytes.start - files[q.input].base));
        let len = pieces.nbytes();
        tensors.push(SourceTensor {
            name,
            dtype,
            shape,
            start,
            end: start + len,
            input,
            gather: Some(Box::new(Gather::Pieces(pieces))),
        });
    }
    let header = SourceHeader {
        header_len: files.iter().map(|f| f.base).sum(),
        metadata: metadata.filter(|m| !m.is_empty()),
        tensors,
        weight_shapes: Vec::new(),
    };
    let mut source = Source::from_parts(dir, files, header);
    // Gathered into one file, a checkpoint changes format even where no dtype changes.
    source.origin = Some(Origin {
        format: Format::DcpSafetensors,
        key: String::new(),
        skipped: Vec::new(),
        globals: Vec::new(),
        unlisted: Vec::new(),
    });
    Ok(source)
}
