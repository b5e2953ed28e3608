//! What verify decides about a destination folder's files beside its weights: a copy holds
//! SRC's bytes; an index what DST's shards make of SRC's index (`written_index`, the text
//! convert writes); an index DST holds beside the output routes none of the output's
//! tensors to another file. Each answer is a `Finding`: the file and what is wrong with it.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::input::InputOptions;
use crate::naming;
use crate::quant::{BLOCKS_SUFFIX, PACKED_SUFFIX, SCALE_SUFFIXES};
use crate::run::fp8config;
use crate::run::json::{self, same_json, Node, Str, Value};
use crate::run::walk::{listing, torch_name, File, Walked};
use crate::source::{open_regular, Source};
use crate::text::{esc, esc_path, format_bytes};
use crate::torch::TorchError;
use crate::vocab::{is_quantized_dtype, Target};

/// Configs and indexes above this size are not what they claim to be.
pub const MAX_JSON_BYTES: u64 = 256 << 20;

/// A file of DST that is not what SRC's makes of it: its path relative to DST and what is
/// wrong (a message template).
pub type Finding = (OsString, String);

/// An index that does not agree with the shards, or is no index (`Error::BadIndex`).
fn bad_index(path: &Path, why: String) -> Error {
    Error::BadIndex {
        path: path.to_path_buf(),
        why,
        refused: false,
    }
}

/// An error's template without the path it starts with.
pub(crate) fn why(e: &Error) -> String {
    let template = e.template();
    let prefix = format!("{}: ", esc_path(e.path().unwrap_or(Path::new(""))));
    template
        .strip_prefix(&prefix)
        .unwrap_or(&template)
        .to_string()
}

const CONFIG_DIFFERS: &str = "is not SRC's config with the dtype set to the target";

/// An index as read: its text and its weight map (tensor, shard path relative to DST).
pub type Index = (PathBuf, String, Vec<(String, String)>);

/// SRC's config as verify judges DST's: DST's rel, SRC's text, whether the target
/// dequantizes it (its quantization keys dropped), and why convert refuses SRC for it (its
/// quantization is no scheme stcast dequantizes, while its weights would be dequantized).
pub type SrcConfig = (PathBuf, String, bool, Option<String>);

/// What verify checks in DST besides the weights, in this order: the indexes DST holds
/// beside the output (`stray`, against the output's weight files `output`), the copies
/// (DST's rel, SRC's file), the configs (`SrcConfig`), the indexes (DST's rel, SRC's text
/// and weight map), the model configs DST adds to an FP8 output (`added`), and the FP8
/// quantization_config files beside weights no model config describes (`sides`: where
/// convert writes one, which DST may lack).
#[derive(Debug, Default)]
pub struct Companions {
    pub stray: Vec<PathBuf>,
    pub output: Vec<PathBuf>,
    pub copies: Vec<(PathBuf, PathBuf)>,
    pub configs: Vec<SrcConfig>,
    pub indexes: Vec<Index>,
    /// SRC's weight files (DST's rel, SRC's path): the record convert put in the shards
    /// (`record::own_index_record`), it put in their indexes.
    pub sources: HashMap<PathBuf, PathBuf>,
    pub added: Vec<PathBuf>,
    pub sides: Vec<PathBuf>,
}

/// Is `rel` a model config (`config.json`), which an FP8 target gives its
/// quantization_config?
fn is_model_config(rel: &Path) -> bool {
    rel.file_name() == Some(std::ffi::OsStr::new("config.json"))
}

/// The first file of `c` that DST does not hold as convert writes it under the target
/// `to` (None: not known; the configs then judged as bf16's); `loose` takes JSON with the
/// same data for the same file, and another tool's FP8 model config when it describes the
/// tensors beside it (`fp8config::same_config`).
pub fn check(
    dst: &Path,
    to: Option<Target>,
    loose: bool,
    c: &Companions,
) -> Result<Option<Finding>> {
    let finding = |rel: &Path, template: String| Ok(Some((rel.as_os_str().into(), template)));
    let fp8 = to.is_some_and(|t| t.strategy().is_some());
    let target = to.unwrap_or(Target::Bf16);
    let (configs, indexes): (Vec<PathBuf>, Vec<PathBuf>) = c
        .stray
        .iter()
        .cloned()
        .partition(|r| !r.as_os_str().as_encoded_bytes().ends_with(b".index.json"));
    if let Some(found) = stray_index(dst, &indexes, &c.output)? {
        return Ok(Some(found));
    }
    if let Some(found) = stray_config(dst, &configs) {
        return Ok(Some(found));
    }
    for (rel, src) in &c.copies {
        if !same_bytes(src, &dst.join(rel)) {
            let why = "differs from the file in SRC (copies must be byte for byte)";
            return finding(rel, why.to_string());
        }
    }
    let describe =
        |p: fp8config::Problem| format!("does not describe the FP8 tensors beside it: {p}");
    let not_json = |rel: &Path| bad_index(&dst.join(rel), "not valid JSON".into());
    for (rel, text, dequantize, refused) in &c.configs {
        if let Some(why) = refused {
            // convert refuses such a source: no output of it is stcast's (or loaded right).
            return finding(rel, format!("in SRC: {why}"));
        }
        let mut want =
            json::written_config(text, target, *dequantize, None).map_err(|_| not_json(rel))?;
        if fp8 && is_model_config(rel) {
            // The config must describe the tensors beside it (strict and loose alike): a
            // loader trusts its `ignore`, strategy and format. Strict mode then wants
            // stcast's bytes; loose (another tool's config) SRC's other keys.
            let got = read_bounded(&dst.join(rel))?;
            let modules = fp8config::Modules::beside(dst, rel)?;
            if let Some(wrong) = fp8config::same_config(&got, text, target, &modules) {
                return finding(rel, describe(wrong));
            }
            if loose {
                continue;
            }
            let ignore = Some(&modules.unquantized[..]);
            let written = json::written_config(text, target, false, ignore);
            want = written.map_err(|_| not_json(rel))?;
        }
        match read_bounded(&dst.join(rel)) {
            Ok(got) if same_json(&got, want.as_bytes(), loose) => continue,
            Ok(_) => return finding(rel, CONFIG_DIFFERS.into()),
            Err(e) => return finding(rel, e.template()),
        }
    }
    // The record convert put in the shards, it put in their indexes.
    let shard = c
        .indexes
        .iter()
        .find_map(|(_, _, m)| m.iter().map(|(_, s)| s).min());
    let record = match shard.and_then(|s| Some((c.sources.get(Path::new(s))?, s))) {
        Some((src, shard)) => crate::record::own_index_record(src, &dst.join(shard))?,
        None => None,
    };
    for (rel, text, weight_map) in &c.indexes {
        let deq = dequantized(dst, weight_map);
        let scales = Scales::of(fp8 && !deq, deq);
        let got = read_bounded(&dst.join(rel)).and_then(|got| {
            // An index an earlier stcast wrote holds no record: the shards' alone say it.
            let record = record.as_deref().filter(|_| has_record(&got));
            let want = written_index(dst, rel, text, weight_map, scales, record)?;
            Ok((want, got))
        });
        let same = match got {
            Ok((want, got)) => same_json(&got, want.as_bytes(), loose),
            Err(e) => return finding(rel, e.template()),
        };
        if !same {
            let why = "is not SRC's index with the total size of DST's shards";
            return finding(rel, why.to_string());
        }
    }
    // Every shard of one conversion holds its record: a shard of another run (other
    // options) verifies alone, but is no part of this output.
    for (_, _, weight_map) in &c.indexes {
        if let Some(record) = &record {
            let files: Vec<&Path> = shards(weight_map).into_iter().map(Path::new).collect();
            let Some(&of) = files.first() else { continue };
            let files = files.into_iter().map(|rel| (rel, dst.join(rel)));
            if let Some(found) = other_record(files, record, of)? {
                return Ok(Some(found));
            }
        }
    }
    // Loose ignores extra files, but not a model config beside FP8 shards (one copied in
    // after a DCP or single-file source was re-sharded): a loader trusts it. Without a
    // quantization_config, it reads the E4M3 codes as the weights. A file that is not a
    // JSON object is no model config.
    for rel in c.added.iter().filter(|_| fp8) {
        let doc = read_bounded(&dst.join(rel)).map(|b| serde_json::from_slice(&b));
        let Ok(Ok(serde_json::Value::Object(doc))) = doc else {
            continue;
        };
        let modules = fp8config::Modules::beside(dst, rel)?;
        if modules.quantized.is_empty() {
            continue;
        }
        if let Some(p) = fp8config::config_problem(&doc, target, &modules) {
            return finding(rel, describe(p));
        }
    }
    for rel in &c.sides {
        if !dst.join(rel).exists() {
            // Strict: convert wrote it, the only description of the FP8 weights beside it,
            // unless a model config there describes them (a lone file's `--config`).
            let described = dst.join(rel).with_file_name("config.json").exists();
            // Nor where the shards beside it hold no FP8 weight: convert writes none there
            // (those shards are checked against SRC, so none should).
            let none =
                || fp8config::Modules::beside(dst, rel).is_ok_and(|m| m.quantized.is_empty());
            if fp8 && !loose && !described && !none() {
                let why = "is the quantization_config convert writes of the FP8 shards beside \
                           it (no model config describes them), but not in DST";
                return finding(rel, why.into());
            }
            continue;
        }
        if !fp8 {
            let why = "is an FP8 quantization_config, beside shards not quantized";
            return finding(rel, why.into());
        }
        let modules = fp8config::Modules::beside(dst, rel)?;
        let want = json::config_text("{}", target, false, Some(&modules.unquantized));
        let want = want.map_err(|_| not_json(rel))?.unwrap_or_default();
        if read_bounded(&dst.join(rel))? != want.as_bytes() {
            let why = "is not the quantization_config of the FP8 shards beside it";
            return finding(rel, why.into());
        }
    }
    Ok(None)
}

/// The FP8 target DST's model config at `rel` describes (its strategy,
/// `fp8config::strategy_target`), if it is one: verify reads it there rather than guess it
/// from a weight whose scale fits both. None when it says none, or cannot be read (the
/// config check says what is wrong with it).
pub fn configured(dst: &Path, rel: &Path) -> Option<Target> {
    let text = read_bounded(&dst.join(rel)).ok()?;
    std::str::from_utf8(&text).ok()?;
    fp8config::strategy_target(&text)
}

/// Does an index's text (as read) hold a record of convert's options?
pub fn has_record(text: &[u8]) -> bool {
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| json::index_record(t).ok().flatten())
        .is_some()
}

/// The first of DST's weight files `(rel, path)` whose record of convert's options is not
/// `record`, the one DST's file `of` holds: a file of another run, with other options,
/// though it verifies alone. None when each holds `record`.
pub fn other_record<'a, P: AsRef<Path>>(
    files: impl IntoIterator<Item = (&'a Path, P)>,
    record: &str,
    of: &Path,
) -> Result<Option<Finding>> {
    for (rel, path) in files {
        let source = Source::open(path.as_ref())?;
        if crate::record::find(source.header.metadata.as_deref()) != Some(record) {
            let why = format!(
                "was converted with other options than {} (their stcast records differ): \
                 DST mixes the files of two runs",
                esc_path(of)
            );
            return Ok(Some((rel.as_os_str().into(), why)));
        }
    }
    Ok(None)
}

/// The tensors of DST's weight file `path` (name, bytes), from its header, as a shard
/// group reads it.
fn tensors(path: &Path) -> Result<Vec<(String, u64)>> {
    let source = Source::open_any(path, &InputOptions::default())?;
    let tensors = source.header.tensors.iter();
    Ok(tensors.map(|t| (t.name.clone(), t.len())).collect())
}

/// The shards a weight map names, sorted, each once.
fn shards(weight_map: &[(String, String)]) -> Vec<&str> {
    let mut shards: Vec<&str> = weight_map.iter().map(|(_, s)| s.as_str()).collect();
    shards.sort_unstable();
    shards.dedup();
    shards
}

/// DST's index at `rel` against the shards written: every tensor where it says, every
/// shard tensor listed. The total size of the tensors (the index's `total_size`).
pub fn index_total(dst: &Path, rel: &Path, weight_map: &[(String, String)]) -> Result<u64> {
    let mut total = 0;
    let mut held: HashMap<&str, HashSet<String>> = HashMap::new();
    let shards = shards(weight_map);
    for &shard in &shards {
        let written = tensors(&dst.join(shard))?;
        total += written.iter().map(|(_, n)| n).sum::<u64>();
        held.insert(shard, written.into_iter().map(|(name, _)| name).collect());
    }
    let changed = "(was the source changed during the run?)";
    let (tensor, rel) = (esc, esc_path(rel));
    let map: HashMap<&str, &str> = weight_map
        .iter()
        .map(|(t, s)| (t.as_str(), s.as_str()))
        .collect();
    for (t, shard) in weight_map {
        if !held[shard.as_str()].contains(t) {
            return Err(bad_index(
                &dst.join(shard),
                format!(
                    "the index {rel} lists tensor `{}` there, but the file written does not \
                     hold it {changed}",
                    tensor(t)
                ),
            ));
        }
    }
    for shard in shards {
        let mut names: Vec<&String> = held[shard].iter().collect();
        names.sort_unstable();
        if let Some(t) = names
            .into_iter()
            .find(|t| map.get(t.as_str()) != Some(&shard))
        {
            return Err(bad_index(
                &dst.join(shard),
                format!(
                    "holds tensor `{}`, which the index {rel} does not list there {changed}",
                    tensor(t)
                ),
            ));
        }
    }
    Ok(total)
}

/// How an index's weight map follows the FP8 scales of DST's shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scales {
    /// As SRC's index lists them.
    Kept,
    /// An FP8 target's: each quantized weight's scale added (in the weight's shard).
    Added,
    /// A dequantized checkpoint's: the tensors the shards no longer hold left out.
    Dropped,
}

impl Scales {
    /// An FP8 target's (`fp8`), a dequantized checkpoint's, or neither.
    pub fn of(fp8: bool, dequantized: bool) -> Scales {
        match (fp8, dequantized) {
            (true, _) => Scales::Added,
            (false, true) => Scales::Dropped,
            (false, false) => Scales::Kept,
        }
    }
}

/// What a packed weight's name ends with; its output drops it (`quant::dequantizable`).
const PACKED: [&str; 2] = [PACKED_SUFFIX, BLOCKS_SUFFIX];

/// The index at `rel` as convert writes it for the shards DST holds: SRC's `text` (shards
/// renamed) with its weight map following the shards' `scales` and the total size of their
/// tensors (`json::index`); each entry checked against the shards (`index_total`).
pub fn written_index(
    dst: &Path,
    rel: &Path,
    text: &str,
    weight_map: &[(String, String)],
    scales: Scales,
    record: Option<&str>,
) -> Result<String> {
    let not_json = |_| bad_index(&dst.join(rel), "not valid JSON".into());
    if scales == Scales::Kept {
        let total = index_total(dst, rel, weight_map)?;
        return json::index(Some(text), total, None, false, record).map_err(not_json);
    }
    let mut map: Vec<(String, String)> = Vec::with_capacity(weight_map.len());
    let by_name: HashMap<&str, &str> = weight_map
        .iter()
        .map(|(t, s)| (t.as_str(), s.as_str()))
        .collect();
    if scales == Scales::Added {
        map.extend(weight_map.iter().cloned());
    }
    let mut split: HashSet<String> = HashSet::new();
    for shard in shards(weight_map) {
        let names: Vec<String> = tensors(&dst.join(shard))?
            .into_iter()
            .map(|t| t.0)
            .collect();
        if scales == Scales::Dropped {
            // A packed weight is unpacked under its weight's name (`X.weight_packed`,
            // `X_blocks`).
            let held: HashSet<&str> = names.iter().map(String::as_str).collect();
            for (t, s) in weight_map.iter().filter(|(_, s)| s == shard) {
                let out = PACKED.iter().find_map(|p| t.strip_suffix(p)).unwrap_or(t);
                if held.contains(out) {
                    map.push((out.to_string(), s.clone()));
                }
            }
            continue;
        }
        // Fused MoE experts split per expert (`experts::split`): their pieces, in the
        // fused tensor's shard, take its place.
        let listed_here = |n: &str| by_name.get(n) == Some(&shard);
        let piece = |n: &str| {
            crate::experts::fused_names(n)
                .iter()
                .any(|f| listed_here(f))
        };
        let held: HashSet<&str> = names.iter().map(String::as_str).collect();
        for name in &names {
            if let Some(fused) = crate::experts::fused_names(name)
                .into_iter()
                .find(|f| listed_here(f) && !held.contains(f.as_str()))
            {
                split.insert(fused);
            }
        }
        for name in names {
            let weight = name.strip_suffix(SCALE_SUFFIXES[0]);
            let new = !by_name.contains_key(&*name);
            if new && (weight.is_some_and(|w| listed_here(w) || piece(w)) || piece(&name)) {
                map.push((name, shard.to_string()));
            }
        }
    }
    map.retain(|(t, _)| !split.contains(t));
    if scales == Scales::Added {
        map.sort();
        map.dedup_by(|a, b| a.0 == b.0);
    }
    let total = index_total(dst, rel, &map)?;
    json::index(Some(text), total, Some(&map), false, record).map_err(not_json)
}

/// Does DST hold a dequantization of the checkpoint `weight_map` indexes: the first FP8
/// scale or packed weight it lists is not in the shard written?
pub fn dequantized(dst: &Path, weight_map: &[(String, String)]) -> bool {
    let is_scale = |t: &str| {
        SCALE_SUFFIXES
            .iter()
            .any(|s| t.ends_with(&format!(".weight{s}")))
            || PACKED.iter().any(|p| t.ends_with(p))
    };
    let Some((scale, shard)) = weight_map.iter().find(|(t, _)| is_scale(t)) else {
        return false;
    };
    tensors(&dst.join(shard)).is_ok_and(|names| !names.iter().any(|(t, _)| t == scale))
}

/// The first model config of DST that is no part of the verified output (one SRC has
/// none of, or one convert left out) and says its folder's weights are quantized while
/// they hold no quantized tensor (`beside::problem`): a loader would read them as such.
/// An FP8 output's configs are the folder code's (they must describe its scales).
fn stray_config(dst: &Path, rels: &[PathBuf]) -> Option<Finding> {
    for rel in rels {
        let at = dst.join(rel);
        let dir = crate::output::parent_dir(&at);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let quantized = entries.filter_map(|e| e.ok()).any(|e| {
            let path = e.path();
            let weights = path
                .as_os_str()
                .as_encoded_bytes()
                .ends_with(b".safetensors");
            let open = || Source::open_any(&path, &InputOptions::default()).ok();
            weights
                && open()
                    .is_none_or(|s| s.header.tensors.iter().any(|t| is_quantized_dtype(t.dtype)))
        });
        let Ok(text) = read_bounded(&at) else {
            continue;
        };
        let dense = crate::run::beside::Weights::Dense;
        let why = crate::run::beside::problem(&String::from_utf8_lossy(&text), dense, false);
        if let (false, Some(why)) = (quantized, why) {
            let why = format!("does not describe the weights beside it: {why}");
            return Some((rel.as_os_str().into(), why));
        }
    }
    None
}

/// The first index of DST that is no part of the verified output (`rels`) and is wrong:
/// it must hold what the shards it names hold, and place none of the output's tensors
/// (those of its weight files `output`) in another file (an earlier cut's index, left
/// beside the output, routes a loader to its stale shards).
fn stray_index(dst: &Path, rels: &[PathBuf], output: &[PathBuf]) -> Result<Option<Finding>> {
    if rels.is_empty() {
        return Ok(None);
    }
    let found: HashSet<PathBuf> = listing(dst)?.into_iter().map(PathBuf::from).collect();
    let mut holder: HashMap<String, &PathBuf> = HashMap::new();
    for rel in output {
        // A file that cannot be read: the weights' own check says what is wrong with it.
        for (name, _) in tensors(&dst.join(rel)).unwrap_or_default() {
            holder.insert(name, rel);
        }
    }
    for rel in rels {
        let checked = read_index(&dst.join(rel), rel, false, &found, &[])
            .and_then(|(_, map)| index_total(dst, rel, &map).map(|_| map));
        let mut map = match checked {
            Ok(map) => map,
            Err(e) => {
                let why = format!("an index DST holds beside the output: {}", why(&e));
                return Ok(Some((rel.into(), why)));
            }
        };
        map.sort();
        for (tensor, shard) in map {
            if let Some(&held) = holder.get(&tensor).filter(|&&h| *h != Path::new(&shard)) {
                let why = format!(
                    "places tensor `{}` in `{}`, while the verified output holds it in `{}`: a \
                     loader reading this index loads another file's",
                    esc(&tensor),
                    esc(&shard),
                    esc_path(held)
                );
                return Ok(Some((rel.into(), why)));
            }
        }
    }
    Ok(None)
}

/// Each index the walk found, read (`read_index`) against the weight files it found.
pub fn read_indexes(walked: &Walked, prefixes: &[String]) -> Result<Vec<ReadIndex>> {
    let found: HashSet<PathBuf> = walked
        .weights
        .iter()
        .map(|w| w.rel.clone().into())
        .collect();
    let read = walked.indexes.iter().map(|f| {
        let torch = f.src_rel.is_some();
        let (text, map) = read_index(&f.path, f.rel.as_ref(), torch, &found, prefixes)?;
        Ok((f.clone(), text, map))
    });
    read.collect()
}

/// An index as a run reads it: the file, its text (shard names already renamed, prefixes
/// stripped), its weight map (tensor, shard relative to the top folder).
pub type ReadIndex = (File, String, Vec<(String, String)>);

/// The index at `path` (`rel` in its folder): its text and its weight map, each shard a
/// plain relative name in the index's folder that names a file of `found` (relative to
/// the top folder). A PyTorch index (`torch`) names `.bin` shards: its text and map get
/// their safetensors names. Its tensor names lose `prefixes` as every input's do
/// (`naming::strip_prefixes`), in its text too; two that would be one are refused, naming
/// both, as a file's are. Refused before any shard is opened.
pub fn read_index(
    path: &Path,
    rel: &Path,
    torch: bool,
    found: &HashSet<PathBuf>,
    prefixes: &[String],
) -> Result<(String, Vec<(String, String)>)> {
    let refuse = |why: String| bad_index(path, why);
    let bytes = read_bounded(path)?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        refuse(format!("not valid JSON: not UTF-8 text (at byte {at})"))
    })?;
    let doc = match json::parse(&text) {
        Ok(_) | Err(_) if json::depth(&text) > json::MAX_DEPTH => {
            let why = format!("JSON nested deeper than {} levels", json::MAX_DEPTH);
            return Err(refuse(why));
        }
        Ok(doc) => doc,
        Err(e) => return Err(refuse(format!("not valid JSON (at byte {})", e.0))),
    };
    let Some(map) = doc.get("weight_map").and_then(Node::dict) else {
        return Err(refuse(
            "not a safetensors index (no weight_map object)".into(),
        ));
    };
    if doc
        .get("metadata")
        .is_some_and(|m| !matches!(m.value, Value::Object(_) | Value::Literal("null")))
    {
        return Err(refuse("`metadata` is not an object".into()));
    }
    if map.is_empty() {
        // Nothing to convert it with, and a loader reading it would load no tensor.
        return Err(refuse(
            "its weight_map is empty: the index names no shard (remove it, or list the \
             shards' tensors)"
                .into(),
        ));
    }
    let folder = rel.parent().unwrap_or(Path::new(""));
    let Some(folder) = folder.to_str() else {
        return Err(refuse("its folder's name is not UTF-8 text".into()));
    };
    let mut out = Vec::with_capacity(map.len());
    let mut renames = HashMap::new();
    for (tensor, name) in map {
        let tensor = match tensor {
            Str::Text(t) => t.to_string(),
            Str::Wide(_) => return Err(refuse("a tensor name is not UTF-8 text".into())),
        };
        let Value::Str(Str::Text(plain)) = &name.value else {
            return Err(not_plain(path, &tensor, name));
        };
        if !is_plain_name(plain) {
            return Err(not_plain(path, &tensor, name));
        }
        let mut plain = plain.to_string();
        if torch {
            let Some(new) = torch_name(plain.as_ref()) else {
                return Err(refuse(format!(
                    "names shard `{}`, which is not a PyTorch weight file of the Hugging \
                     Face layout (pytorch_model*.bin)",
                    esc(&plain)
                )));
            };
            let new = new.to_string_lossy().into_owned();
            renames.insert(plain, new.clone());
            plain = new;
        }
        let shard = match folder {
            "" => plain.clone(),
            _ => format!("{folder}/{plain}"),
        };
        if !found.contains(Path::new(&shard)) {
            let why = format!("names shard `{}`, which is missing", esc(&plain));
            return Err(refuse(why));
        }
        out.push((tensor, shard));
    }
    let text = match renames.is_empty() {
        true => text,
        false => json::rename_shards(&text, &|old| renames.get(old).cloned())
            .map_err(|_| refuse("not valid JSON".into()))?,
    };
    strip_index(path, text, out, prefixes)
}

/// An index's text and weight map (`read_index`) with `prefixes` dropped from its tensor
/// names; two names that would be one refused, naming both (`TorchError::DuplicateName`,
/// as for the tensors of a file).
fn strip_index(
    path: &Path,
    text: String,
    mut map: Vec<(String, String)>,
    prefixes: &[String],
) -> Result<(String, Vec<(String, String)>)> {
    let stripped = |i: usize| naming::strip_prefixes(&map[i].0, prefixes);
    if prefixes.is_empty() || (0..map.len()).all(|i| stripped(i).len() == map[i].0.len()) {
        return Ok((text, map));
    }
    if let Some((first, second)) = naming::first_repeat(map.len(), stripped) {
        return Err(Error::Checkpoint {
            path: path.to_path_buf(),
            error: TorchError::DuplicateName {
                name: stripped(first).to_string(),
                first: map[first].0.clone(),
                second: map[second].0.clone(),
            },
        });
    }
    let text = json::rename_tensors(&text, &|old| {
        let new = naming::strip_prefixes(old, prefixes);
        (new.len() != old.len()).then(|| new.to_string())
    })
    .map_err(|_| bad_index(path, "not valid JSON".into()))?;
    for (name, _) in &mut map {
        let at = name.len() - naming::strip_prefixes(name, prefixes).len();
        name.drain(..at);
    }
    Ok((text, map))
}

/// A shard `rel` that the index at `path` names, and the index `other` too: refused (by a
/// folder conversion, a re-sharding and verify alike): which checkpoint it belongs to, and
/// which index a loader should read, is anyone's guess.
pub(crate) fn named_twice(path: &Path, rel: &str, other: &Path) -> Error {
    Error::BadIndex {
        path: path.to_path_buf(),
        why: format!(
            "names {}, which {} names too; stcast cannot tell which checkpoint it belongs to \
             (remove one of the two indexes)",
            esc(rel),
            esc_path(other)
        ),
        refused: true,
    }
}

/// A weight map entry whose shard is no plain name: refused.
fn not_plain(path: &Path, tensor: &str, name: &Node<'_>) -> Error {
    let shown = match &name.value {
        Value::Str(Str::Text(s)) => format!("'{s}'"),
        _ => json::Dump::indented(None).text(name),
    };
    Error::BadIndex {
        path: path.to_path_buf(),
        why: format!(
            "weight_map entry `{}` names {}: shard names must be plain relative names inside \
             the index's folder (no '..', no absolute path, no NUL)",
            esc(tensor),
            esc(&shown)
        ),
        refused: true,
    }
}

fn is_plain_name(name: &str) -> bool {
    !(name.is_empty() || name.contains(['\0', '\\']) || name.starts_with('/'))
        && name.split('/').all(|p| !matches!(p, "" | "." | ".."))
}

/// The whole content of the regular file `path`, at most `MAX_JSON_BYTES`: exactly the
/// size its metadata gives.
pub(crate) fn read_bounded(path: &Path) -> Result<Vec<u8>> {
    let (file, meta) = open_regular(path)?;
    if meta.len() > MAX_JSON_BYTES {
        let (size, limit) = (format_bytes(meta.len()), format_bytes(MAX_JSON_BYTES));
        let why = format!("{size}, more than the {limit} a file of this kind may have");
        return Err(bad_index(path, why));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // One byte more reveals a file that grew; each read asks at least a page: some /proc
    // files refuse reads of odd sizes (EINVAL).
    let mut left = meta.len() + 1;
    let mut chunk = vec![0; 4096];
    while left > 0 {
        chunk.resize(left.clamp(4096, 1 << 20) as usize, 0);
        let n = (&file)
            .read(&mut chunk)
            .map_err(|e| Error::io(path, "cannot read", e))?;
        if n == 0 {
            break;
        }
        bytes.extend_from_slice(&chunk[..n]);
        left = left.saturating_sub(n as u64);
    }
    if bytes.len() as u64 != meta.len() {
        let got = match bytes.len() as u64 > meta.len() {
            true => "more".to_string(),
            false => bytes.len().to_string(),
        };
        let why = format!("its size says {} bytes, reading it gave {got}", meta.len());
        return Err(bad_index(path, why));
    }
    Ok(bytes)
}

/// The text of the JSON file `path` (bounded, UTF-8), as read before its JSON is parsed.
pub(crate) fn read_json_text(path: &Path) -> Result<String> {
    String::from_utf8(read_bounded(path)?).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        bad_index(
            path,
            format!("not valid JSON: not UTF-8 text (at byte {at})"),
        )
    })
}

/// Do the files `a` and `b` hold the same bytes (false when one cannot be read)?
pub fn same_bytes(a: &Path, b: &Path) -> bool {
    let open = |p| std::fs::File::open(p).map(|f| std::io::BufReader::with_capacity(1 << 20, f));
    let (Ok(mut a), Ok(mut b)) = (open(a), open(b)) else {
        return false;
    };
    use std::io::BufRead;
    loop {
        let (Ok(x), Ok(y)) = (a.fill_buf(), b.fill_buf()) else {
            return false;
        };
        let n = x.len().min(y.len());
        if n == 0 || x[..n] != y[..n] {
            return x.len() == y.len() && n == 0;
        }
        a.consume(n);
        b.consume(n);
    }
}

#[cfg(test)]
mod tests;
