//! Re-sharding: the tensors of a group of input files (the shards one index names, or a
//! single file) written as output shards of at most a given size on disk.
//!
//! The whole output plan comes from the headers, and from what the caller read of the data
//! beforehand where a tensor's fate depends on it (`PlanOptions::keep_names`, the tensors
//! that would overflow; `PlanOptions::unquantized`, an FP8 target's weights holding NaN or
//! inf), so that each shard's plan is the one its conversion writes. Tensors are taken in
//! input order (file by file, each in data order) and assigned greedily: a shard is closed
//! when the next tensor would make its file, header included, larger than the limit; a
//! tensor larger than the limit gets a shard of its own. Each shard is then an ordinary output of
//! `plan::plan`, read from a composite `Source` of the files it spans, so the conversion,
//! its memory bound and its atomic publication are those of one file.
//!
//! `verify`: a checkpoint DST holds re-sharded, verified by tensor name against SRC's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use safetensors::tensor::Dtype;

use crate::convert::Options;
use crate::task::ConvertTask;
use crate::verify::{Verifier, VerifyOptions};

use crate::dtype::{width_rank, Action};
use crate::error::{Error, Result, Warning};
use crate::header::{SourceHeader, SourceTensor, PREFIX};
use crate::input::{InputOptions, Origin, TORCH_METADATA};
use crate::plan::{self, encode_entry, encode_metadata, Plan, PlanOptions, Role};
use crate::source::{InputFile, Source};
use crate::text::esc_path;
use crate::torch::Format;
use crate::vocab::{Unmatched, WarningKind};

pub mod resharded;

/// A tensor of a group: its input file and its position in that file's header.
pub type At = (usize, usize);

/// The input files of one group, opened and validated, and what every output shard
/// carries.
pub struct Group {
    /// Its files in input order, each held open: a later pass reads the very files that
    /// were validated, and sees any change since (`InputFile::duplicate`).
    inputs: Vec<InputFile>,
    /// Per input path, its files in `inputs` (one, but for a checkpoint of several files:
    /// a DCP folder's rank files).
    spans: Vec<std::ops::Range<usize>>,
    headers: Vec<SourceHeader>,
    by_name: HashMap<String, At>,
    /// Per file: how its checkpoint was read (`None`: a safetensors file). `verify` infers
    /// `keep` from it as for a single checkpoint.
    origins: Vec<Option<Origin>>,
    /// The checkpoint folders its files were read from (a DCP or ZeRO folder): every
    /// output shard's source carries them, so that no output lands in one.
    folders: Vec<std::path::PathBuf>,
    /// Warnings about the group itself (metadata that differs between its files).
    pub warnings: Vec<Warning>,
    /// Each piece of a fused MoE expert tensor split from the transposed layout: its name ->
    /// the fused tensor's (an output shard holding pieces names them: `Source::transposed`).
    transposed: HashMap<String, String>,
}

/// One output shard: which tensors, and what its file will be.
#[derive(Clone, Debug)]
pub struct ShardSpec {
    /// Its tensors in input order.
    pub tensors: Vec<At>,
    /// The output file's size, header included.
    pub file_len: u64,
    /// Bytes of its tensors in the input, and in the output (what an index's `total_size`
    /// adds up).
    pub data_in: u64,
    pub data_out: u64,
    /// The SHA-256 of the output header (what `resume` compares).
    pub header_sha256: String,
    pub converted: usize,
    pub kept: usize,
    /// FP8 targets: the scale tensors it writes beside its quantized weights (an index
    /// lists them with the weights).
    pub scales: Vec<String>,
    /// FP8 input: the scales a dequantization uses and does not write (nor index).
    pub dropped: Vec<String>,
}

/// A group's output shards.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    pub shards: Vec<ShardSpec>,
    /// More than one shard: the group gets an index, and its shards `"format"` metadata.
    pub indexed: bool,
    /// Warnings of the plan: the group's, and `"format": "pt"` added.
    pub warnings: Vec<Warning>,
    /// The `keep` patterns that match no tensor of the group, in the order given.
    pub keep_unmatched: Vec<String>,
}

/// One tensor as the size arithmetic sees it: its output entries (none for an FP8 scale a
/// dequantization drops; two for a quantized weight, with its scale).
struct Item {
    entries: Vec<Entry>,
}

/// One output header entry and its data.
struct Entry {
    /// `width_rank` of its output dtype: the output groups by it, widest first.
    rank: usize,
    /// Bytes of its header entry without the digits of its two offsets.
    fixed: u64,
    /// Bytes in the output.
    out_len: u64,
}

impl Group {
    /// Open and validate the files `paths` (in input order: safetensors files or PyTorch
    /// checkpoints, read under `input`), without reading their data. A tensor name may
    /// appear once in the whole group.
    pub fn open(paths: &[PathBuf], input: &InputOptions) -> Result<Group> {
        let mut inputs: Vec<InputFile> = Vec::with_capacity(paths.len());
        let mut spans = Vec::with_capacity(paths.len());
        let mut headers = Vec::with_capacity(paths.len());
        let mut origins = Vec::with_capacity(paths.len());
        let mut by_name = HashMap::new();
        let mut warnings = Vec::new();
        let mut folders = Vec::new();
        // A prefix to strip is judged over the whole group: one warning if no file's
        // names start with it.
        let mut unused: Option<Vec<String>> = None;
        let mut transposed = Vec::new();
        let mut pieces = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let source = Source::open_any(path, input)?;
            let mine = &source.unused_prefixes;
            let kept = unused.get_or_insert_with(|| mine.clone());
            kept.retain(|p| mine.contains(p));
            // Judged over the whole group, below: one note of the experts split transposed.
            let read = source.warnings().into_iter();
            let whole = [WarningKind::UnmatchedPrefix, WarningKind::TransposedExperts];
            warnings.extend(read.filter(|w| !whole.contains(&w.kind)));
            transposed.extend(source.transposed.iter().cloned());
            pieces.extend(
                (source.pieces.iter())
                    .filter(|(_, fused)| source.transposed.contains(fused))
                    .map(|(piece, fused)| (piece.clone(), fused.clone())),
            );
            let safetensors = source.format() == Format::Safetensors;
            for (j, t) in source.header.tensors.iter().enumerate() {
                if let Some((k, _)) = by_name.insert(t.name.clone(), (i, j)) {
                    return Err(Error::invalid_header(
                        path,
                        format!(
                            "tensor `{}` is also in {}, of the same checkpoint",
                            t.name,
                            paths[k].display()
                        ),
                    ));
                }
            }
            let Source {
                files,
                header,
                origin,
                folders: read_from,
                ..
            } = source;
            folders.extend(read_from);
            origins.push(origin);
            // Held open for the whole run: what reading the header mapped goes now. (A
            // checkpoint's pickle is at its end, among its data.)
            for f in files.iter().filter(|_| safetensors) {
                f.release_head(header.data_start());
            }
            spans.push(inputs.len()..inputs.len() + files.len());
            inputs.extend(files);
            headers.push(header);
        }
        let unused = unused.unwrap_or_default();
        warnings.extend(unused.iter().map(|p| crate::input::unmatched_prefix(p)));
        if !transposed.is_empty() {
            warnings.push(crate::experts::transposed_note(&transposed));
        }
        if let Some(k) = (1..headers.len()).find(|&k| headers[k].metadata != headers[0].metadata) {
            warnings.push(Warning::new(
                WarningKind::MetadataDiffers,
                format!(
                    "{} and {} have different __metadata__; every output shard carries the \
                     first one's",
                    esc_path(&paths[0]),
                    esc_path(&paths[k])
                ),
            ));
        }
        Ok(Group {
            inputs,
            spans,
            headers,
            by_name,
            origins,
            folders,
            warnings,
            transposed: pieces,
        })
    }

    /// What the group is called in messages: its first file.
    pub fn path(&self) -> &Path {
        &self.inputs[0].path
    }

    /// Every tensor's name, in input order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.all().map(|t| self.tensor(t).name.as_str())
    }

    /// The tensor at `at`.
    pub fn tensor(&self, (i, j): At) -> &SourceTensor {
        &self.headers[i].tensors[j]
    }

    /// Every tensor, in input order.
    fn all(&self) -> impl Iterator<Item = At> + '_ {
        self.headers
            .iter()
            .enumerate()
            .flat_map(|(i, h)| (0..h.tensors.len()).map(move |j| (i, j)))
    }

    /// The `__metadata__` of every output shard: the first file's, with `"format": "pt"`
    /// added when the shards get an index and it has none (transformers refuses shards
    /// without it). Also says whether it was added.
    pub fn metadata(&self, indexed: bool) -> (Option<Vec<(String, String)>>, bool) {
        let meta = self.headers[0].metadata.clone();
        let has_format = meta
            .as_ref()
            .is_some_and(|m| m.iter().any(|(k, _)| k == TORCH_METADATA.0));
        if !indexed || has_format {
            return (meta, false);
        }
        let mut meta = meta.unwrap_or_default();
        meta.push((TORCH_METADATA.0.to_string(), TORCH_METADATA.1.to_string()));
        (Some(meta), true)
    }

    /// The tensors named that the group holds, in input order.
    pub fn select<'a>(&self, names: impl IntoIterator<Item = &'a str>) -> Vec<At> {
        let mut out: Vec<At> = names
            .into_iter()
            .filter_map(|n| self.by_name.get(n).copied())
            .collect();
        out.sort_unstable();
        out
    }

    /// The conversion of the output shard holding the tensors `names` (a shard of `plan`)
    /// into `dst`: the usual task, reading from the files they are in.
    pub fn task(
        &self,
        names: &[String],
        indexed: bool,
        dst: &Path,
        opts: &Options,
    ) -> Result<ConvertTask> {
        let at = self.select(names.iter().map(String::as_str));
        if at.len() != names.len() {
            let missing = names.iter().find(|n| !self.by_name.contains_key(*n));
            return Err(Error::invalid_header(
                self.path(),
                format!(
                    "no tensor `{}` in this checkpoint",
                    missing.map_or("?", |n| n)
                ),
            ));
        }
        ConvertTask::from_source(self.source(&at, indexed)?, dst, opts, Instant::now())
    }

    /// The verification of the file `dst`, an output shard of this group: its tensors are
    /// paired by name with the group's, and it must be what `task` writes for them (in
    /// strict mode; see `Verifier`). A tensor the group lacks is a mismatch.
    pub fn verifier(&self, dst: &Path, indexed: bool, opts: &VerifyOptions) -> Result<Verifier> {
        let started = Instant::now();
        let out = Source::open(dst)?;
        // A dequantized FP8 weight's scales are not in DST, but verifying it reads them.
        let mut names: Vec<String> = Vec::new();
        for t in &out.header.tensors {
            names.push(t.name.clone());
            if t.dtype == Dtype::F8_E4M3 {
                continue; // still FP8: its scale is in DST too
            }
            let zero_point = std::iter::once(&crate::quant::ZERO_POINT_SUFFIX);
            for suffix in crate::quant::SCALE_SUFFIXES.iter().chain(zero_point) {
                names.push(format!("{}{suffix}", t.name));
            }
            if let Some(module) = crate::quant::module_of(&t.name) {
                names.extend(crate::quant::input_scale_names(module));
            }
            // A packed weight unpacked: its codes and every tensor beside them.
            use crate::quant::{BLOCKS_SUFFIX, PACKED_SUFFIX, SCALES_SUFFIX};
            if let Some(module) = crate::quant::module_of(&t.name) {
                let suffixes = crate::quant::companion_suffixes();
                names.extend(suffixes.iter().map(|s| format!("{module}{s}")));
            }
            for suffix in [PACKED_SUFFIX, BLOCKS_SUFFIX, SCALES_SUFFIX] {
                names.push(format!("{}{suffix}", t.name));
            }
        }
        names.sort_unstable();
        names.dedup();
        let at = self.select(names.iter().map(String::as_str));
        let mut src = self.source(&at, indexed)?;
        // A shard of PyTorch input whose every tensor kept its dtype was converted with
        // `keep`, as `verify` infers for one checkpoint.
        src.origin = self.origins[at.first().map_or(0, |t| t.0)].clone();
        Verifier::from_sources(src, out, opts, started)
    }

    /// The header of an output holding `tensors` (in input order), before planning; each
    /// tensor's `input` is its place in the returned list of input files (of `inputs`).
    fn header(&self, tensors: &[At], indexed: bool) -> (SourceHeader, Vec<usize>) {
        let mut paths: Vec<usize> = tensors.iter().map(|t| t.0).collect();
        paths.dedup();
        if paths.is_empty() {
            paths.push(0); // an empty shard still names a file in messages
        }
        // Each used path's files, in order; where each path's first one lands.
        let mut used = Vec::new();
        let mut base = HashMap::new();
        for &p in &paths {
            base.insert(p, used.len());
            used.extend(self.spans[p].clone());
        }
        let mut header_len = 64;
        let list = tensors
            .iter()
            .map(|&(i, j)| {
                let t = &self.headers[i].tensors[j];
                header_len += t.name.len() as u64 + 80;
                let at = base[&i];
                let mut out = SourceTensor {
                    input: at + t.input,
                    ..t.clone()
                };
                if let Some(g) = out.gather.as_deref_mut() {
                    g.offset_inputs(at);
                }
                out
            })
            .collect();
        let weight_shapes = paths
            .iter()
            .flat_map(|&p| self.headers[p].weight_shapes.iter().cloned())
            .collect();
        let header = SourceHeader {
            header_len,
            metadata: self.metadata(indexed).0,
            tensors: list,
            weight_shapes,
        };
        (header, used)
    }

    /// The plan of one output holding `tensors` (in input order).
    pub fn plan_output(&self, tensors: &[At], indexed: bool, opts: &PlanOptions) -> Result<Plan> {
        let (header, used) = self.header(tensors, indexed);
        plan::plan(&self.inputs[used[0]].path, &header, &quiet(opts))
    }

    /// A source holding `tensors` (in input order) read from the files they are in, for a
    /// conversion or a verification. Each file is the one opened by `open`; one that
    /// changed since is refused.
    pub fn source(&self, tensors: &[At], indexed: bool) -> Result<Source> {
        let (header, used) = self.header(tensors, indexed);
        let files = used
            .iter()
            .map(|&i| self.inputs[i].duplicate())
            .collect::<Result<Vec<_>>>()?;
        let mut source = Source::from_parts(&files[0].path.clone(), files, header);
        source.folders = self.folders.clone();
        // The fused experts split transposed that this output holds pieces of (a note).
        for t in &source.header.tensors {
            if let Some(fused) = self.transposed.get(&t.name) {
                if !source.transposed.contains(fused) {
                    source.transposed.push(fused.clone());
                }
            }
        }
        Ok(source)
    }

    /// Assign the tensors to output shards of at most `max_size` bytes on disk (a tensor
    /// larger than that alone), greedily in input order, under `opts`.
    pub fn plan(&self, max_size: u64, opts: &PlanOptions) -> Result<ShardPlan> {
        let opts = quiet(opts);
        let (items, order, keep_unmatched) = self.items(&opts)?;
        // The cut runs in `order`: input order, but an FP8 weight being dequantized with its
        // scales right after it, so that no cut parts them.
        let mut slots: Vec<Option<Item>> = items.into_iter().map(Some).collect();
        let items: Vec<Item> = order.iter().filter_map(|&k| slots[k].take()).collect();
        let mut warnings = self.warnings.clone();
        let meta_len = |indexed: bool| {
            opts.metadata(self.metadata(indexed).0.as_deref()).map(|m| {
                let mut buf = Vec::new();
                encode_metadata(&mut buf, &m);
                buf.len() as u64
            })
        };
        let single = file_len(&items, meta_len(false));
        let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
        if single > max_size && items.len() > 1 {
            let meta = meta_len(true);
            let fits = |a: usize, b: usize| file_len(&items[a..b], meta) <= max_size;
            let mut a = 0;
            while a < items.len() {
                let mut b = longest_run(a, items.len(), fits);
                // A weight alone over the size still takes the scales and zero points it is
                // dequantized with (they follow it, and write nothing): apart, its shard
                // would hold FP8 without a scale.
                while b < items.len() && items[b].entries.is_empty() {
                    b += 1;
                }
                groups.push(a..b);
                a = b;
            }
        }
        if groups.len() <= 1 {
            groups = std::iter::once(0..items.len()).collect();
        }
        let indexed = groups.len() > 1;
        if indexed && self.metadata(true).1 {
            warnings.push(Warning::new(
                WarningKind::FormatAdded,
                "__metadata__ has no \"format\": each shard gets \"format\": \"pt\", which \
                 transformers requires of a sharded checkpoint"
                    .to_string(),
            ));
        }
        let in_order: Vec<At> = self.all().collect();
        let all: Vec<At> = order.iter().map(|&k| in_order[k]).collect();
        let shards = groups
            .into_iter()
            .map(|g| {
                let mut tensors = all[g].to_vec();
                tensors.sort_unstable();
                self.spec(&tensors, indexed, &opts)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ShardPlan {
            shards,
            indexed,
            warnings,
            keep_unmatched,
        })
    }

    /// Each tensor's output dtype, size and header entry, from the plan of its own file
    /// (what a tensor becomes depends on it alone); and the keep patterns no file matches.
    fn items(&self, opts: &PlanOptions) -> Result<(Vec<Item>, Vec<usize>, Vec<String>)> {
        let mut items = Vec::new();
        let mut order = Vec::new();
        let mut buf = Vec::new();
        let mut unmatched = opts.keep.clone();
        for (span, h) in self.spans.iter().zip(&self.headers) {
            let planned = plan::plan(&self.inputs[span.start].path, h, opts)?;
            unmatched.retain(|p| planned.keep_unmatched.contains(p));
            let first = items.len();
            items.extend((0..h.tensors.len()).map(|_| Item {
                entries: Vec::new(),
            }));
            order.extend(fp8_order(h, &planned).into_iter().map(|k| first + k));
            for t in &planned.tensors {
                let s = &h.tensors[t.source];
                buf.clear();
                match t.role {
                    Role::Tensor => {
                        let (name, shape) = t.out_name_shape(s);
                        encode_entry(&mut buf, name, t.dtype, &shape, (0, 0))
                    }
                    Role::Scale(q) => encode_entry(
                        &mut buf,
                        &crate::quant::scale_name(&s.name),
                        t.dtype,
                        &q.scale_shape(),
                        (0, 0),
                    ),
                }
                items[first + t.source].entries.push(Entry {
                    rank: width_rank(t.dtype),
                    fixed: buf.len() as u64 - 2,
                    out_len: t.end - t.start,
                });
            }
        }
        Ok((items, order, unmatched))
    }

    /// Every tensor's bytes, in input order.
    pub fn sizes(&self) -> impl Iterator<Item = u64> + '_ {
        self.all().map(|t| self.tensor(t).len())
    }

    /// The spec of the shard holding `tensors`, from its real plan.
    fn spec(&self, tensors: &[At], indexed: bool, opts: &PlanOptions) -> Result<ShardSpec> {
        let plan = self.plan_output(tensors, indexed, opts)?;
        let data_in = tensors.iter().map(|&t| self.tensor(t).len()).sum();
        let renamed: std::collections::HashSet<usize> = plan
            .tensors
            .iter()
            .filter_map(|t| match t.action {
                Action::Dequantize(d) => {
                    let name = &self.tensor(tensors[t.source]).name;
                    (d.out_name(name) != name).then_some(t.source)
                }
                _ => None,
            })
            .collect();
        Ok(ShardSpec {
            tensors: tensors.to_vec(),
            file_len: plan.file_len(),
            data_in,
            data_out: plan.data_len(),
            header_sha256: crate::text::sha256_hex(&plan.header),
            converted: plan.converted(),
            kept: plan.kept(),
            scales: plan
                .tensors
                .iter()
                .filter_map(|t| {
                    let s = self.tensor(tensors[t.source]);
                    match (t.role, t.action) {
                        (Role::Scale(_), _) => Some(crate::quant::scale_name(&s.name)),
                        // A packed weight, written under its unpacked name.
                        (_, Action::Dequantize(d)) if d.out_name(&s.name) != s.name => {
                            Some(d.out_name(&s.name).to_string())
                        }
                        _ => None,
                    }
                })
                .collect(),
            // And packed weights, listed under their unpacked names with `scales`.
            dropped: plan
                .reasons
                .iter()
                .zip(tensors)
                .enumerate()
                .filter(|&(k, (r, _))| *r == plan::Reason::Dropped || renamed.contains(&k))
                .map(|(_, (_, &t))| self.tensor(t).name.clone())
                .collect(),
        })
    }
}

/// The order the cut walks one file's tensors in: input order, each FP8 weight that `planned`
/// dequantizes followed by the scales and zero points it is dequantized with
/// (`Reason::Dropped`), which must land in its shard.
fn fp8_order(h: &SourceHeader, planned: &Plan) -> Vec<usize> {
    let n = h.tensors.len();
    if !planned.reasons.contains(&plan::Reason::Dequantized) {
        return (0..n).collect();
    }
    let mut with: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut attached = vec![false; n];
    let by_name: HashMap<&str, usize> = h
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    for t in &planned.tensors {
        if let crate::dtype::Action::Dequantize(d) = t.action {
            let mut own: Vec<usize> = d.companions().collect();
            let name = d.out_name(&h.tensors[t.source].name);
            let module = crate::quant::module_of(name).unwrap_or("");
            let shape = format!("{module}{}", crate::header::WEIGHT_SHAPE_SUFFIX);
            let activations = crate::quant::input_scale_names(module);
            for n in activations.iter().chain([&shape]) {
                if let Some(&k) = by_name.get(n.as_str()) {
                    own.push(k);
                }
            }
            for k in own {
                if planned.reasons[k] == plan::Reason::Dropped && !attached[k] {
                    attached[k] = true;
                    with[t.source].push(k);
                }
            }
        }
    }
    let mut order = Vec::with_capacity(n);
    for i in (0..n).filter(|&i| !attached[i]) {
        order.push(i);
        order.extend(&with[i]);
    }
    order
}

/// Plan options for one shard: keep patterns are judged over the whole checkpoint by the
/// caller, so one that matches nothing in this shard says nothing.
fn quiet(opts: &PlanOptions) -> PlanOptions {
    PlanOptions {
        unmatched: Unmatched::Ignore,
        ..opts.clone()
    }
}

/// From `a`, the end of the longest run of items that `fits(a, end)`, at least one item:
/// galloping, then bisecting (sizes only grow as items are added).
fn longest_run(a: usize, n: usize, fits: impl Fn(usize, usize) -> bool) -> usize {
    let mut lo = a + 1; // one item always makes a shard
    let mut hi = n + 1; // the first end known not to fit
    let mut step = 1;
    while lo < n {
        let b = (lo + step).min(n);
        if fits(a, b) {
            lo = b;
            step *= 2;
        } else {
            hi = b;
            break;
        }
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(a, mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The exact size of the file `plan::plan` writes for `items` (in input order) with a
/// `__metadata__` entry of `meta` bytes: the arithmetic of `plan::encode_header` and the
/// width grouping of `plan::plan`, without building the header.
fn file_len(items: &[Item], meta: Option<u64>) -> u64 {
    let entries: Vec<&Entry> = items.iter().flat_map(|t| &t.entries).collect();
    let n = entries.len() as u64;
    // `{`, `}`, the entries, a comma between two entries and one after the metadata.
    let mut json = 2 + meta.unwrap_or(0) + n.saturating_sub(1);
    if meta.is_some() && n > 0 {
        json += 1;
    }
    let mut ranks: Vec<usize> = entries.iter().map(|t| t.rank).collect();
    ranks.sort_unstable_by(|a, b| b.cmp(a));
    ranks.dedup();
    let mut offset = 0u64;
    for rank in ranks {
        for t in entries.iter().filter(|t| t.rank == rank) {
            json += t.fixed + digits(offset) + digits(offset + t.out_len);
            offset += t.out_len;
        }
    }
    PREFIX as u64 + json.div_ceil(8) * 8 + offset
}

/// Decimal digits of `n`.
fn digits(n: u64) -> u64 {
    n.checked_ilog10().map_or(1, |d| d as u64 + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::Rng;
    use crate::vocab::Target;

    #[test]
    fn galloping_finds_the_longest_run() {
        for n in 1..40 {
            for limit in 0..45 {
                // Item k weighs 1: the run from a fits while it holds at most `limit` items.
                let end = longest_run(3.min(n - 1), n, |a, b| b - a <= limit);
                let a = 3.min(n - 1);
                let want = (a + limit.max(1)).min(n);
                assert_eq!(end, want, "n={n} limit={limit}");
            }
        }
    }

    /// A group of `files` files of random tensors (names, dtypes, shapes), in a temp folder.
    fn random_group(tag: &str, seed: u64, files: usize) -> (PathBuf, Vec<PathBuf>) {
        let dir = std::env::temp_dir().join(format!("stcast-shard-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut rng = Rng(seed);
        // Seeds 1 mod 4 are planned for FP8 targets, which refuse a quantized input whole
        // (`plan::already_quantized`): their files hold no F8/F4 tensor.
        let dtypes: &[&str] = if seed % 4 == 1 {
            &["F32", "F64", "F16", "BF16", "I64", "U8", "I32"]
        } else {
            &[
                "F32", "F64", "F16", "BF16", "I64", "U8", "F8_E4M3", "I32", "F4",
            ]
        };
        let mut paths = Vec::new();
        for f in 0..files {
            let mut json = String::from("{");
            if f == 0 && seed.is_multiple_of(2) {
                json.push_str(r#""__metadata__":{"step":"7","é":"x"},"#);
            }
            let mut at = 0u64;
            let count = 1 + rng.below(9);
            for k in 0..count {
                let dtype = dtypes[rng.below(dtypes.len() as u64) as usize];
                let size = match dtype {
                    "F64" | "I64" => 8,
                    "F32" | "I32" => 4,
                    "F16" | "BF16" => 2,
                    _ => 1,
                };
                let shape: Vec<u64> = (0..rng.below(3)).map(|_| rng.below(300)).collect();
                let mut elems: u64 = shape.iter().product();
                if dtype == "F4" && !elems.is_multiple_of(2) {
                    elems += 1; // F4 packs two per byte: keep whole bytes
                }
                let shape = if dtype == "F4" { vec![elems] } else { shape };
                let len = if dtype == "F4" {
                    elems / 2
                } else {
                    elems * size
                };
                if k > 0 {
                    json.push(',');
                }
                let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
                let suffix = if seed % 4 == 1 { ".weight" } else { "" };
                json.push_str(&format!(
                    r#""t{f}.{k}\"q{suffix}":{{"dtype":"{dtype}","shape":[{}],"data_offsets":[{at},{}]}}"#,
                    dims.join(","),
                    at + len
                ));
                at += len;
            }
            json.push('}');
            let path = dir.join(format!("m{f}.safetensors"));
            std::fs::write(&path, crate::testutil::file(&json, at as usize)).unwrap();
            paths.push(path);
        }
        (dir, paths)
    }

    #[test]
    fn the_size_arithmetic_is_the_planned_file_size() {
        let mut quantized = 0;
        for seed in 1..60u64 {
            let (dir, paths) = random_group(&format!("arith{seed}"), seed, 1 + seed as usize % 4);
            let group = Group::open(&paths, &InputOptions::default()).unwrap();
            // Random dtypes: F8/F4 beside F32 too (`allow_quantized`).
            let opts = PlanOptions {
                allow_quantized: true,
                // Half the seeds record options in each output's `__metadata__`.
                record: (seed % 2 == 0).then(|| format!("{{\"to\":\"é{seed}\"}}")),
                // Seeds 1 mod 4 name their tensors `*.weight`: FP8 targets quantize the 2-D
                // float ones, each with a scale entry.
                ..PlanOptions::new(match seed % 8 {
                    1 => Target::Fp8,
                    5 => Target::Fp8Block,
                    _ if seed % 3 == 0 => Target::F16,
                    _ => Target::Bf16,
                })
            };
            let (items, order, _) = group.items(&opts).unwrap();
            assert_eq!(order, (0..items.len()).collect::<Vec<_>>());
            let all: Vec<At> = group.all().collect();
            let mut rng = Rng(seed);
            for _ in 0..20 {
                let a = rng.below(all.len() as u64 + 1) as usize;
                let b = a + rng.below((all.len() - a) as u64 + 1) as usize;
                for indexed in [false, true] {
                    let plan = group.plan_output(&all[a..b], indexed, &opts).unwrap();
                    let meta = opts
                        .metadata(group.metadata(indexed).0.as_deref())
                        .map(|m| {
                            let mut buf = Vec::new();
                            encode_metadata(&mut buf, &m);
                            buf.len() as u64
                        });
                    assert_eq!(file_len(&items[a..b], meta), plan.file_len(), "seed {seed}");
                    quantized += plan.quantized();
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
        assert!(quantized > 0, "the FP8 seeds quantize weights");
    }

    #[test]
    fn shards_are_greedy_bounded_and_cover_every_tensor_once() {
        let (mut split, mut alone) = (0, 0);
        for seed in 1..40u64 {
            let (dir, paths) = random_group(&format!("greedy{seed}"), seed, 1 + seed as usize % 3);
            let group = Group::open(&paths, &InputOptions::default()).unwrap();
            let opts = PlanOptions {
                allow_quantized: true,
                ..PlanOptions::new(Target::Bf16)
            };
            let all: Vec<At> = group.all().collect();
            for max in [1, 200, 700, 1500, 5000, 1 << 40] {
                let plan = group.plan(max, &opts).unwrap();
                let got: Vec<At> = plan.shards.iter().flat_map(|s| s.tensors.clone()).collect();
                assert_eq!(got, all, "seed {seed} max {max}");
                assert_eq!(plan.indexed, plan.shards.len() > 1);
                let mut next = 0;
                for s in &plan.shards {
                    next += s.tensors.len();
                    assert!(s.file_len <= max || s.tensors.len() == 1, "seed {seed}");
                    split += usize::from(plan.indexed && s.tensors.len() > 1);
                    alone += usize::from(s.file_len > max);
                    // Closed only when the next tensor would not fit.
                    if plan.indexed && next < all.len() {
                        let mut more = s.tensors.clone();
                        more.push(all[next]);
                        let bigger = group.plan_output(&more, true, &opts).unwrap();
                        assert!(bigger.file_len() > max, "seed {seed} max {max}");
                    }
                }
                if plan.shards.len() == 1 {
                    let whole = group.plan_output(&all, false, &opts).unwrap();
                    assert!(whole.file_len() <= max || all.len() <= 1, "seed {seed}");
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
        // Both cases were met: shards of several tensors, and tensors too big alone.
        assert!(split > 20 && alone > 20, "{split} {alone}");
    }
}
