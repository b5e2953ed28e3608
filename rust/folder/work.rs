//! The units of work of a folder run: one output file each, one code path for a plain run and
//! a re-sharding (`Work`, planned by `WorkTask`).
//!
//! A group is the set of weight files one index names; every other weight file is a group of
//! its own (`resharded::groups_of`). A re-sharding (`Cut`) plans each group into output
//! shards of at most a given size (`shard::Group::plan`), from what was read first where a
//! tensor's fate depends on its values (kept from overflow; an FP8 target's weights holding
//! NaN or inf, which stay BF16), and writes each group's index anew. A plain run is the same
//! plan without a cut: each weight file a group of its own, whose one unit is the file
//! converted whole under its safetensors name, the source's indexes edited.
//!
//! Each unit is proven done by one manifest entry (`entry`, `find_entry`): the inputs it reads
//! as they were, the options, its header. The `Work` also answers what a run asks of its plan
//! before and after writing: the outputs and their sizes, `--shard`'s split, resume's proofs
//! (`Judged`, the survey's `Judge`), the FP8 configs' text and the indexes checked against
//! the shards written. It holds no Python: a Rust task of the whole run can use it as it is.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::{common_prefix_warnings, fingerprint, read_json, FolderPlan, PlanTask};
use crate::convert::{Options, Tuning};
use crate::error::{Error, Result, Warning};
use crate::given::{Given, Settings};
use crate::naming::{index_file_name, shard_file_name, split_rel};
use crate::run::beside::FOLDER_SIDE_CONFIG;
use crate::run::check;
use crate::run::fp8config;
use crate::run::json::{self, Node};
use crate::run::manifest::{self, Input};
use crate::run::survey::{self, Kind, Proof};
use crate::run::walk::File;
use crate::shard;
use crate::shard::resharded::{named_groups, Member};
use crate::task::{ConvertTask, InspectTask, Task};
use crate::verify::VerifyReport;
use crate::vocab::{Fp8Skip, OnOverflow, ReasonCode, Unmatched, WarningKind};

/// A re-sharding: the output shards' size, and what was read of the data before (None: read
/// here).
#[derive(Debug, Default)]
pub struct Cut {
    pub max_size: u64,
    /// Whether a checkpoint folder's links are followed, as its groups read it.
    pub follow_links: bool,
    /// Per weight file (in the plan's order), the tensors `on_overflow` keep keeps.
    pub keep_names: Option<Vec<Vec<String>>>,
    /// FP8 targets: per weight file, its weights that hold NaN or inf.
    pub unquantized: Option<Vec<Vec<String>>>,
}

/// A re-sharding's index: its rel, its text, its weight map (tensor, shard rel).
pub type NewIndex = (OsString, String, Vec<(String, String)>);
/// An index a run writes: its rel, the source's text or the new content, its weight map.
pub type IndexMap<'a> = (&'a OsStr, &'a str, &'a [(String, String)]);
/// An index checked against the shards written: its rel, its content, the source's size
/// (None: new) and path (if renamed).
pub type CheckedIndex = (OsString, String, Option<u64>, Option<OsString>);

/// One output file of the weights: an output shard of a re-sharding, or a weight file
/// converted whole in a plain run.
#[derive(Debug, Clone)]
pub struct Unit {
    /// The output's relative path.
    pub rel: OsString,
    /// In `Work::groups`.
    pub group: usize,
    /// Its tensors, input order (a whole file: none listed, all converted).
    pub names: Vec<String>,
    /// The output file's bytes (also what `--shard` balances).
    pub size: u64,
    /// Tensor bytes read from the input.
    pub data_bytes: u64,
    /// Input bytes it stands for in reports: its tensor bytes, the first shard of a group
    /// also the rest of the group's input files, so that a group's shards add up to its files.
    pub input_bytes: u64,
    /// Tensor bytes written.
    pub target_bytes: u64,
    /// Of the planned output header (a whole file's plan does not know what a scan keeps:
    /// its entry proves it by the header recorded).
    pub header_sha256: String,
    /// The input files it reads (in `FolderPlan::weights`).
    pub inputs: Vec<usize>,
    pub tensors_converted: usize,
    pub tensors_kept: usize,
    /// A plain run's unit: its one input converted whole, named after it.
    pub whole: bool,
}

/// Input files that make one output: an index's shards, or a lone weight file.
pub struct WorkGroup {
    /// Its files (in `FolderPlan::weights`), input order.
    pub inputs: Vec<usize>,
    /// Its own stem, where `name` renamed its output: (folder, stem).
    pub renamed: Option<(OsString, OsString)>,
    /// More than one output shard: the group gets an index.
    pub indexed: bool,
    /// A re-sharding's index: its rel, its text and its weight map (tensor, shard rel).
    pub index: Option<NewIndex>,
    /// A re-sharded group's files, opened while planning: its conversion reads the very
    /// files that were planned (a whole file is opened when converted).
    opened: Option<shard::Group>,
    /// FP8 targets: its weights that hold NaN or inf (None: another target).
    unquantized: Option<Vec<String>>,
    /// Its tensors kept from overflow, read before (None: a whole file's conversion reads).
    keep_names: Option<Vec<String>>,
}

/// The plan of a folder run's output units.
pub struct Work {
    pub plan: FolderPlan,
    /// A re-sharding's output shard size (None: a plain run).
    pub max_size: Option<u64>,
    pub groups: Vec<WorkGroup>,
    pub units: Vec<Unit>,
    /// What the plan said (a re-sharding's), each with the source file it is about.
    pub warnings: Vec<(Warning, Option<OsString>)>,
    /// Each weight file's fingerprint, which `--resume` compares.
    pub hashes: Vec<String>,
    /// What the outputs record of the run's options (None under `no_record`).
    pub record: Option<String>,
    /// The run's options (`to`, precision, how the source is read, `name`).
    settings: Settings,
    /// The options the outputs record, when not those planned with (`finalize` plans a plain
    /// run with the shard runs' companion policy only).
    recorded: Option<Settings>,
}

/// The stages of a `WorkTask`.
enum Stage {
    /// The folder's plan, one weight file a step.
    Plan(Box<PlanTask>),
    /// Read the weight files whose tensors' fate depends on their values, one a step.
    Read(usize, Option<Box<InspectTask>>),
    /// Plan the groups, one a step.
    Group(usize),
    Done,
}

/// The plan of a folder run's units, stepped (a weight file's plan, a read, a group a step):
/// `finish` gives it.
pub struct WorkTask {
    stage: Stage,
    work: Work,
    cut: Option<Cut>,
    groups: Vec<crate::shard::resharded::Group>,
    /// A lone file's group is judged here (a folder's files were judged by its plan).
    allow_quantized: bool,
    keep_names: HashMap<OsString, Vec<String>>,
    unquantized: Option<HashMap<OsString, Vec<String>>>,
    said: Vec<Vec<Warning>>,
    /// Output rel -> what writes it.
    taken: HashMap<OsString, String>,
}

impl WorkTask {
    /// The work of a folder run of `src` (a folder; with `single`, a lone checkpoint
    /// re-sharded into a folder) under `settings`, re-sharded by `cut` if given. With
    /// `check_quantized`, a quantized checkpoint is refused.
    pub fn new(
        src: &Path,
        settings: &Settings,
        check_quantized: bool,
        single: bool,
        cut: Option<Cut>,
        recorded: Option<Settings>,
    ) -> Result<WorkTask> {
        let (stage, plan) = match single {
            true => (Stage::Read(0, None), lone_plan(src, settings)?),
            false => {
                let task = PlanTask::new(src, settings, Tuning::default(), check_quantized)?;
                (Stage::Plan(Box::new(task)), FolderPlan::default())
            }
        };
        let mut task = WorkTask {
            stage,
            work: Work {
                plan,
                max_size: cut.as_ref().map(|c| c.max_size),
                groups: Vec::new(),
                units: Vec::new(),
                warnings: Vec::new(),
                hashes: Vec::new(),
                record: None,
                settings: settings.clone(),
                recorded,
            },
            cut,
            groups: Vec::new(),
            allow_quantized: !check_quantized || !single,
            keep_names: HashMap::new(),
            unquantized: None,
            said: Vec::new(),
            taken: HashMap::new(),
        };
        // A lone checkpoint's model config is the model config of the folder it makes.
        task.work.settings.config = None;
        if single {
            task.work.hashes = vec![fingerprint(&task.work.plan.weights[0].path)?];
            task.planned()?;
        }
        Ok(task)
    }

    /// The folder is planned: what the groups need.
    fn planned(&mut self) -> Result<()> {
        let w = &mut self.work;
        let fp8 = w.settings.target()?.strategy().is_some();
        if w.hashes.is_empty() {
            w.hashes = (w.plan.planned.iter())
                .map(|p| p.header_sha256.clone())
                .collect();
        }
        w.settings.packed_config = w.plan.model_config.clone();
        w.record = match &mut w.recorded {
            Some(r) => {
                r.packed_config = w.plan.model_config.clone();
                r.record()?
            }
            None => w.settings.record()?,
        };
        let from_plan = || {
            let planned = w.plan.weights.iter().zip(&w.plan.planned);
            let found = planned.filter_map(|(f, p)| Some((f.rel.clone(), p.unquantized.clone()?)));
            found.collect::<HashMap<_, _>>()
        };
        let by_rel = |v: Vec<Vec<String>>| {
            let rels = w.plan.weights.iter().map(|f| f.rel.clone());
            rels.zip(v).collect::<HashMap<_, _>>()
        };
        match &mut self.cut {
            Some(cut) => {
                w.settings.follow_links = cut.follow_links;
                self.keep_names = cut.keep_names.clone().map(by_rel).unwrap_or_default();
                // Judged over the groups' plans.
                w.plan.keep_unmatched = w.settings.keep.clone();
                self.unquantized = match fp8 {
                    true => Some(cut.unquantized.take().map_or_else(from_plan, by_rel)),
                    false => None,
                };
                let members: Vec<Member> = w.plan.weights.iter().map(Member::from).collect();
                let indexed: Vec<_> = (w.plan.indexes.iter())
                    .map(|(f, _, map)| (f.into(), map.clone()))
                    .collect();
                let named = w.settings.name.is_some();
                self.groups = named_groups(&members, &indexed, named)?;
                for (f, _) in &w.plan.configs {
                    self.taken.insert(f.rel.clone(), "a config".into());
                }
                for f in w.plan.copies.iter().chain(&w.plan.late_copies) {
                    self.taken.insert(f.rel.clone(), "a copied file".into());
                }
            }
            None => {
                let found = from_plan();
                self.unquantized = (!found.is_empty()).then_some(found);
                self.whole_files()?;
            }
        }
        Ok(())
    }

    /// A plain run's units: each weight file whole, under its safetensors name.
    fn whole_files(&mut self) -> Result<()> {
        let w = &mut self.work;
        for (k, (f, p)) in w.plan.weights.iter().zip(&w.plan.planned).enumerate() {
            let info = |key: &str| p.info.get(key).and_then(serde_json::Value::as_u64);
            let number = |key: &str| info(key).unwrap_or(0);
            w.units.push(Unit {
                rel: f.rel.clone(),
                group: k,
                names: Vec::new(),
                size: number("output_bytes"),
                data_bytes: number("data_bytes"),
                input_bytes: f.size,
                target_bytes: p.out_data,
                header_sha256: (p.info.get("output_header_sha256"))
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                inputs: vec![k],
                tensors_converted: number("tensors_converted") as usize,
                tensors_kept: number("tensors_kept") as usize,
                whole: true,
            });
            let unquantized =
                (self.unquantized.as_ref()).map(|u| u.get(&f.rel).cloned().unwrap_or_default());
            w.groups.push(WorkGroup {
                inputs: vec![k],
                renamed: None,
                indexed: false,
                index: None,
                opened: None,
                unquantized,
                keep_names: None,
            });
        }
        Ok(())
    }

    /// The inspection of weight file `i` if its tensors' fate must be read first.
    fn read(&self, i: usize) -> Result<Option<Box<InspectTask>>> {
        let w = &self.work;
        let Some(cut) = &self.cut else {
            return Ok(None);
        };
        let keep = w.settings.on_overflow()? == OnOverflow::Keep && cut.keep_names.is_none();
        let rel = &w.plan.weights[i].rel;
        let nonfinite = self
            .unquantized
            .as_ref()
            .is_some_and(|u| !u.contains_key(rel));
        if !keep && !nonfinite {
            return Ok(None);
        }
        let mut s = w.settings.clone();
        let text = if keep { "keep" } else { "warn" };
        s.on_overflow = Some(Given {
            text: Some(text.into()),
            whole: None,
            repr: format!("'{text}'"),
        });
        s.keep_unmatched = Unmatched::Ignore;
        s.allow_quantized = Some(true);
        let opts = s.inspect(Tuning::default(), false)?;
        let task = InspectTask::new(&w.plan.weights[i].path, false, &opts, None)?;
        Ok(Some(Box::new(task)))
    }

    /// What the read of weight file `i` found.
    fn absorb(&mut self, i: usize, task: Box<InspectTask>) -> Result<()> {
        let found = task.finish()?;
        let rows = found.rows();
        let rel = self.work.plan.weights[i].rel.clone();
        let names = |keep: fn(&crate::task::TensorRow<'_>) -> bool| {
            let kept = rows.tensors.iter().filter(|t| keep(t));
            kept.map(|t| t.name.to_string()).collect::<Vec<_>>()
        };
        let cut = self.cut.as_ref().map(|c| c.keep_names.is_none());
        if cut == Some(true) && self.work.settings.on_overflow()? == OnOverflow::Keep {
            let kept = names(|t| t.reason == ReasonCode::KeepOverflow);
            self.keep_names.insert(rel.clone(), kept);
        }
        if let Some(u) = &mut self.unquantized {
            u.insert(rel, names(|t| t.not_quantized == Some(Fp8Skip::NonFinite)));
        }
        Ok(())
    }

    /// Plan group `k` into output shards.
    fn plan_group(&mut self, k: usize) -> Result<()> {
        let mut g = self.groups[k].clone();
        let w = &mut self.work;
        // `name` names the output of the one group (its own stem kept for the survey).
        let renamed = w.settings.name.as_ref().map(|name| {
            let own = std::mem::replace(&mut g.stem, name.into());
            (g.dir.clone().into_os_string(), own)
        });
        let max_size = self.cut.as_ref().map_or(0, |c| c.max_size);
        let at: Vec<usize> = (g.inputs.iter())
            .map(|m| {
                w.plan
                    .weights
                    .iter()
                    .position(|f| f.path == m.path)
                    .unwrap_or(0)
            })
            .collect();
        let files: Vec<File> = at.iter().map(|&i| w.plan.weights[i].clone()).collect();
        let paths: Vec<PathBuf> = files.iter().map(|f| f.path.clone()).collect();
        let opened = shard::Group::open(&paths, &w.settings.input()?)?;
        // What was read first of the group's files.
        let mine = |m: &HashMap<OsString, Vec<String>>| {
            let found = files.iter().filter_map(|f| m.get(&f.rel));
            found.flatten().cloned().collect::<Vec<_>>()
        };
        let keep_names = mine(&self.keep_names);
        let unquantized = self.unquantized.as_ref().map(mine);
        let mut s = w.settings.clone();
        s.keep_names = Some(keep_names.clone());
        s.unquantized = unquantized.clone();
        s.allow_quantized = Some(self.allow_quantized);
        let planned = opened.plan(max_size, &s.shard_plan()?)?;
        let first = files[0].source_rel().to_os_string();
        // The note of experts split transposed names them all, over the group's files: it is
        // about the group (its index), not its first file.
        let shown = |kind: WarningKind| match (&g.index, kind) {
            (Some(index), WarningKind::TransposedExperts) => {
                let f = w.plan.indexes.iter().find(|(f, _, _)| f.path == index.path);
                f.map_or(first.clone(), |(f, _, _)| f.source_rel().to_os_string())
            }
            _ => first.clone(),
        };
        let said = planned.warnings.iter();
        let said = said.filter(|x| x.kind != WarningKind::UnmatchedPrefix);
        let warnings: Vec<_> = said.map(|x| (x.clone(), Some(shown(x.kind)))).collect();
        w.warnings.extend(warnings);
        self.said.push(planned.warnings.clone());
        let kept = &planned.keep_unmatched;
        w.plan.keep_unmatched.retain(|p| kept.contains(p));
        let sizes: u64 = files.iter().map(|f| f.size).sum();
        let data: u64 = planned.shards.iter().map(|s| s.data_in).sum();
        let overhead = sizes.saturating_sub(data);
        let (n, dir) = (planned.shards.len(), g.dir.as_os_str());
        let mut units = Vec::with_capacity(n);
        for (i, spec) in planned.shards.iter().enumerate() {
            let name = shard_name(&g.stem, i + 1, n);
            let mut inputs: Vec<usize> = spec.tensors.iter().map(|t| at[t.0]).collect();
            inputs.dedup();
            units.push((
                Unit {
                    rel: join(dir, &name),
                    group: w.groups.len(),
                    names: (spec.tensors.iter())
                        .map(|&t| opened.tensor(t).name.clone())
                        .collect(),
                    size: spec.file_len,
                    data_bytes: spec.data_in,
                    input_bytes: spec.data_in + if i == 0 { overhead } else { 0 },
                    target_bytes: spec.data_out,
                    header_sha256: spec.header_sha256.clone(),
                    inputs,
                    tensors_converted: spec.converted,
                    tensors_kept: spec.kept,
                    whole: false,
                },
                spec,
            ));
        }
        let index = match planned.indexed {
            true => Some(index_of(&g, &units, w.record.as_deref(), &files[0])?),
            false => None,
        };
        let index_rel = index.as_ref().map(|(rel, _, _)| rel.clone());
        let index_file = g.index.as_ref().and_then(|m| {
            let f = w.plan.indexes.iter().find(|(f, _, _)| f.path == m.path);
            f.map(|(f, _, _)| f.source_rel().to_os_string())
        });
        let what = format!(
            "the output of {}",
            index_file.as_ref().unwrap_or(&first).to_string_lossy()
        );
        let outputs = units.iter().map(|(u, _)| u.rel.clone()).chain(index_rel);
        for rel in outputs {
            if let Some(other) = self.taken.insert(rel.clone(), what.clone()) {
                return Err(Error::OutputsCollide {
                    path: rel.into(),
                    first: other,
                    second: what,
                });
            }
        }
        w.units.extend(units.into_iter().map(|(u, _)| u));
        w.groups.push(WorkGroup {
            inputs: at,
            renamed,
            indexed: planned.indexed,
            index,
            opened: Some(opened),
            unquantized,
            keep_names: Some(keep_names),
        });
        Ok(())
    }

    /// The work, once every step is done.
    pub fn finish(mut self) -> Result<Work> {
        if self.cut.is_some() {
            let notes = common_prefix_warnings(&self.said);
            self.work
                .warnings
                .extend(notes.into_iter().map(|n| (n, None)));
        }
        Ok(self.work)
    }
}

impl Task for WorkTask {
    fn step(&mut self, budget: u64) -> Result<bool> {
        match &mut self.stage {
            Stage::Plan(task) => {
                if task.step(budget)? {
                    let Stage::Plan(task) =
                        std::mem::replace(&mut self.stage, Stage::Read(0, None))
                    else {
                        unreachable!()
                    };
                    self.work.plan = task.finish()?;
                    self.planned()?;
                }
            }
            Stage::Read(i, current) => {
                let i = *i;
                if let Some(task) = current {
                    if !task.step(budget)? {
                        return Ok(false);
                    }
                    let task = current.take().unwrap_or_else(|| unreachable!());
                    self.absorb(i, task)?;
                    self.stage = Stage::Read(i + 1, None);
                    return Ok(false);
                }
                let mut next = i;
                while next < self.work.plan.weights.len() {
                    if let Some(task) = self.read(next)? {
                        self.stage = Stage::Read(next, Some(task));
                        return Ok(false);
                    }
                    next += 1;
                }
                self.stage = match self.cut {
                    Some(_) => Stage::Group(0),
                    None => Stage::Done,
                };
            }
            Stage::Group(k) => {
                let k = *k;
                match k < self.groups.len() {
                    true => {
                        self.plan_group(k)?;
                        self.stage = Stage::Group(k + 1);
                    }
                    false => self.stage = Stage::Done,
                }
            }
            Stage::Done => return Ok(true),
        }
        Ok(matches!(self.stage, Stage::Done))
    }

    /// (Planning reads headers: it tells no progress.)
    fn progress(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// Output shard `i` of `n` of a group's, by its stem (one that is not UTF-8 kept as it is).
fn shard_name(stem: &OsStr, i: usize, n: usize) -> OsString {
    let tail = shard_file_name("", i, n);
    OsStr::from_bytes(&[stem.as_bytes(), tail.as_bytes()].concat()).to_os_string()
}

/// A group's index: its rel, its text, its weight map; `record` (convert's options) in its
/// metadata.
fn index_of(
    g: &crate::shard::resharded::Group,
    units: &[(Unit, &shard::ShardSpec)],
    record: Option<&str>,
    first: &File,
) -> Result<NewIndex> {
    let Some(stem) = g.stem.to_str() else {
        return Err(Error::StemNotUtf8 {
            path: first.path.clone(),
            name: first.source_rel().into(),
        });
    };
    // Each tensor once, where its last shard puts it (as a dict's keys).
    let mut names: Vec<(String, String)> = Vec::new();
    let mut weight_map: Vec<(String, String)> = Vec::new();
    let mut at: HashMap<&str, usize> = HashMap::new();
    for (u, spec) in units {
        let rel = u.rel.to_string_lossy().into_owned();
        let base = rel.rsplit('/').next().unwrap_or(&rel).to_string();
        let dropped: std::collections::HashSet<&String> = spec.dropped.iter().collect();
        let kept = u.names.iter().filter(|n| !dropped.contains(n));
        for n in kept.chain(&spec.scales) {
            let k = *at.entry(n).or_insert_with(|| {
                names.push((n.clone(), String::new()));
                weight_map.push((n.clone(), String::new()));
                names.len() - 1
            });
            (names[k].1, weight_map[k].1) = (base.clone(), rel.clone());
        }
    }
    let source = g.index.as_ref().map(|f| read_json(&f.path)).transpose()?;
    let total = units.iter().map(|(u, _)| u.target_bytes).sum();
    let path = g.index.as_ref().map_or(Path::new(""), |f| &f.path);
    let text = json::index(source.as_deref(), total, Some(&names), true, record)
        .map_err(|e| super::not_json(path, e))?;
    let rel = join(g.dir.as_os_str(), OsStr::new(&index_file_name(stem)));
    Ok((rel, text, weight_map))
}

/// The plan of a folder holding only the checkpoint `src`: its name kept, a PyTorch
/// checkpoint's made a safetensors name (`run::place::single_file`). The model's `config`
/// goes beside it as `config.json`, its dtype set; without one, an FP8 target's
/// quantization_config goes to `quantization_config.json`.
fn lone_plan(src: &Path, settings: &Settings) -> Result<FolderPlan> {
    let w = crate::run::place::single_file(src)?;
    let to = settings.target()?;
    let mut configs = Vec::new();
    let bare = |rel: &[u8], path: &Path| File {
        rel: OsStr::from_bytes(rel).to_os_string(),
        path: path.to_path_buf(),
        size: 0,
        mtime_ns: 0,
        src_rel: None,
    };
    if let Some(config) = &settings.config {
        let text = read_json(config)?;
        let doc = json::parse(&text).map_err(|e| super::not_json(config, e))?;
        if to.strategy().is_some() && !matches!(doc.value, json::Value::Object(_)) {
            return Err(Error::FolderConfig {
                path: config.clone(),
                problem: crate::error::ConfigProblem::NotAnObject,
            });
        }
        let content =
            json::config_text(&text, to, false, None).map_err(|e| super::not_json(config, e))?;
        configs.push((bare(b"config.json", config), Some(content.unwrap_or(text))));
    } else if to.strategy().is_some() {
        configs.push((
            bare(FOLDER_SIDE_CONFIG.as_bytes(), &w.path),
            Some("{}".into()),
        ));
    }
    Ok(FolderPlan {
        model_config: settings.config.clone().filter(|_| to.strategy().is_some()),
        planned: Vec::new(),
        weights: vec![w],
        configs,
        ..FolderPlan::default()
    })
}

fn join(dir: &OsStr, name: &OsStr) -> OsString {
    match dir.is_empty() {
        true => name.to_os_string(),
        false => OsStr::from_bytes(&[dir.as_bytes(), b"/", name.as_bytes()].concat()).into(),
    }
}

impl Work {
    /// The kind of a run's units, in messages.
    pub fn noun(&self) -> &'static str {
        match self.max_size {
            Some(_) => "output shards",
            None => "weight files",
        }
    }

    /// Refuse a plain run that would write a copy of the folder of `src` (`on_overflow`
    /// keep may still keep tensors; a re-sharding changes the files whatever the dtypes).
    pub fn check(&self, src: &Path) -> Result<()> {
        let unchanged = self.max_size.is_none() && self.plan.nothing_to_convert.is_some();
        if unchanged && self.settings.on_overflow()? != OnOverflow::Keep {
            let target = self.settings.target()?;
            let path = src.to_path_buf();
            return Err(Error::FolderUnchanged { path, target });
        }
        Ok(())
    }

    /// Every file the run copies opens for reading, as its copy opens it
    /// (`source::open_regular`): one that does not is refused before the first byte is
    /// written, not once the weights are.
    pub fn copies_open(&self) -> Result<()> {
        for f in self.plan.copies.iter().chain(&self.plan.late_copies) {
            crate::source::open_regular(&f.path)?;
        }
        Ok(())
    }

    /// The options unit `i` is converted (and verified) with: the run's, and what was
    /// read of its group's data before.
    pub fn settings(&self, i: usize) -> Settings {
        let g = &self.groups[self.units[i].group];
        Settings {
            keep_names: g.keep_names.clone(),
            unquantized: g.unquantized.clone(),
            // (The plan judged the quantization of the folder or group.)
            allow_quantized: Some(true),
            ..self.settings.clone()
        }
    }

    /// `f` of unit `i`'s group's files, opened (a whole file's, now).
    fn opened<T>(&self, i: usize, f: impl FnOnce(&shard::Group) -> Result<T>) -> Result<T> {
        let g = &self.groups[self.units[i].group];
        if let Some(opened) = &g.opened {
            return f(opened);
        }
        // A whole file is read as the plan read it: its prefixes stripped.
        let mut read = self.settings.clone();
        (read.key, read.follow_links) = (None, false);
        let paths: Vec<PathBuf> = (g.inputs.iter())
            .map(|&k| self.plan.weights[k].path.clone())
            .collect();
        f(&shard::Group::open(&paths, &read.input()?)?)
    }

    /// The conversion of unit `i` into `dst` under `opts` (of `settings`).
    pub fn task(&self, i: usize, dst: &Path, opts: &Options) -> Result<ConvertTask> {
        let u = &self.units[i];
        let indexed = self.groups[u.group].indexed;
        self.opened(i, |group| {
            let names = match u.whole {
                true => group.names().map(str::to_string).collect(),
                false => u.names.clone(),
            };
            group.task(&names, indexed, dst, opts)
        })
    }

    /// Is the file `path` exactly unit `i` as this plan writes it? Its planned header, then
    /// every value verified against the inputs.
    pub fn adoptable(&self, i: usize, path: &Path, tuning: Tuning) -> Result<bool> {
        let u = &self.units[i];
        if manifest::header_sha256(path)? != u.header_sha256 {
            return Ok(false);
        }
        let indexed = self.groups[u.group].indexed;
        let mut opts = self.settings(i).shard_verify(tuning)?;
        self.opened(i, |group| {
            opts.numerics = false;
            let mut verifier = group.verifier(path, indexed, &opts)?;
            crate::task::run(&mut verifier)?;
            let report: VerifyReport = verifier.finish()?;
            Ok(report.mismatch.is_none())
        })
    }

    /// The indexes a whole run writes: its rel, and the source's text (a plain run edits the
    /// source's) or the content (a re-sharding's), and its weight map.
    pub fn index_maps(&self) -> Vec<IndexMap<'_>> {
        match self.max_size {
            Some(_) => (self.groups.iter())
                .filter_map(|g| g.index.as_ref())
                .map(|(rel, text, map)| (rel.as_os_str(), text.as_str(), map.as_slice()))
                .collect(),
            None => (self.plan.indexes.iter())
                .map(|(f, text, map)| (f.rel.as_os_str(), text.as_str(), map.as_slice()))
                .collect(),
        }
    }

    /// Every file a whole run writes: its rel, its kind (`survey::Kind`) and its bytes (an
    /// edited index may grow by its total size's digits); in the order a run writes them.
    pub fn outputs(&self) -> Vec<(OsString, Kind, u64)> {
        let p = &self.plan;
        let units = self.units.iter().map(|u| (&u.rel, Kind::Weights, u.size));
        let copies = p.copies.iter().chain(&p.late_copies);
        let configs = p.configs.iter().map(|(f, c)| {
            let size = c.as_ref().map_or(f.size, |c| c.len() as u64);
            (&f.rel, Kind::Config, size)
        });
        let sizes: Vec<u64> = match self.max_size {
            Some(_) => (self.groups.iter().filter_map(|g| g.index.as_ref()))
                .map(|(_, text, _)| text.len() as u64)
                .collect(),
            None => p.indexes.iter().map(|(f, _, _)| f.size + 64).collect(),
        };
        let indexes = self.index_maps().into_iter().zip(sizes);
        let all = (units.chain(copies.map(|f| (&f.rel, Kind::Copy, f.size))))
            .chain(configs)
            .map(|(rel, kind, size)| (rel.clone(), kind, size))
            .chain(indexes.map(|((rel, _, _), size)| (rel.to_os_string(), Kind::Index, size)));
        // (One file, one line, where it first comes: the last word on it is its kind and size.)
        let mut out: indexmap::IndexMap<OsString, (Kind, u64)> = Default::default();
        out.extend(all.map(|(rel, kind, size)| (rel, (kind, size))));
        out.into_iter()
            .map(|(rel, (kind, size))| (rel, kind, size))
            .collect()
    }

    /// The indexes to write once the weights are, each checked against the shards written
    /// in `dst`: its rel, its content, the source's size (None: new) and path (if renamed).
    /// An FP8 target's list the scales the shards hold.
    pub fn checked_indexes(&self, dst: &Path) -> Result<Vec<CheckedIndex>> {
        if self.max_size.is_some() {
            let mut out = Vec::new();
            for (rel, text, map) in self.index_maps() {
                let written = check::index_total(dst, Path::new(rel), map)?;
                let planned = self.planned_total(rel);
                if written != planned {
                    let path = dst.join(rel);
                    return Err(Error::IndexTotal {
                        path,
                        written,
                        planned,
                    });
                }
                out.push((rel.to_os_string(), text.to_string(), None, None));
            }
            return Ok(out);
        }
        let scales = check::Scales::of(self.fp8(), self.plan.dequantize);
        let record = self.record.as_deref();
        (self.plan.indexes.iter())
            .map(|(f, text, map)| {
                let content =
                    check::written_index(dst, Path::new(&f.rel), text, map, scales, record)?;
                Ok((f.rel.clone(), content, Some(f.size), f.src_rel.clone()))
            })
            .collect()
    }

    /// The total size a re-sharding's index `rel` plans.
    fn planned_total(&self, rel: &OsStr) -> u64 {
        let g = self
            .groups
            .iter()
            .position(|g| g.index.as_ref().is_some_and(|i| i.0 == rel));
        let units = self.units.iter().filter(|u| Some(u.group) == g);
        units.map(|u| u.target_bytes).sum()
    }

    fn fp8(&self) -> bool {
        self.settings.target().is_ok_and(|t| t.strategy().is_some())
    }

    /// Under resume, without a manifest: what the regular file at `rel` in `dst` (weights
    /// or an index) must be to be exactly what this plan writes: the weights' own answer,
    /// an index's bytes (`Known(false)`: none can be told).
    pub fn expected(&self, dst: &Path, rel: &OsStr, kind: Kind, tuning: Tuning) -> Result<Proof> {
        if kind == Kind::Weights {
            let Some(i) = self.units.iter().position(|u| u.rel == rel) else {
                return Ok(Proof::Known(false));
            };
            return Ok(Proof::Known(self.adoptable(i, &dst.join(rel), tuning)?));
        }
        let Some((_, text, map)) = self.index_maps().into_iter().find(|(r, _, _)| *r == rel) else {
            return Ok(Proof::Known(false));
        };
        if self.max_size.is_some() {
            return Ok(Proof::Bytes(text.as_bytes().to_vec()));
        }
        // The source's index with the total size of the planned shards' tensors (FP8: what
        // the shards there, checked before it, make it).
        let record = self.record.as_deref();
        let text = match self.fp8() || self.plan.dequantize {
            true => {
                let scales = check::Scales::of(self.fp8(), self.plan.dequantize);
                check::written_index(dst, Path::new(rel), text, map, scales, record).ok()
            }
            false => {
                let mut shards: Vec<&str> = map.iter().map(|(_, s)| s.as_str()).collect();
                shards.sort_unstable();
                shards.dedup();
                let weights = self.plan.weights.iter().zip(&self.plan.planned);
                let total = (weights.filter(|(f, _)| shards.iter().any(|s| f.rel == *s)))
                    .map(|(_, p)| p.out_data)
                    .sum();
                json::index(Some(text), total, None, false, record).ok()
            }
        };
        Ok(text.map_or(Proof::Known(false), |t| Proof::Bytes(t.into_bytes())))
    }

    /// What the config `rel` is written as in `dst` (None: copied as it is). An FP8
    /// target's model config (and the side config of weights no model config describes)
    /// gets the quantization_config of the shards beside it as written: its `ignore` lists
    /// what they hold unquantized.
    pub fn config_text(&self, dst: &Path, rel: &OsStr) -> Result<Option<String>> {
        let Some((f, content)) = self.plan.configs.iter().find(|(f, _)| f.rel == rel) else {
            return Ok(None);
        };
        let side = split_rel(rel.as_bytes()).1 == FOLDER_SIDE_CONFIG.as_bytes();
        if !self.fp8() || !(super::is_model_config(rel) || side) {
            return Ok(content.clone());
        }
        let text = match content {
            Some(c) => c.clone(),
            None => read_json(&f.path)?,
        };
        let here = split_rel(rel.as_bytes()).0;
        let beside = self
            .units
            .iter()
            .filter(|u| split_rel(u.rel.as_bytes()).0 == here);
        let shards: Vec<PathBuf> = beside.map(|u| dst.join(&u.rel)).collect();
        let ignore = fp8config::Modules::of_files(&shards)?.unquantized;
        let written = json::config_text(&text, self.settings.target()?, false, Some(&ignore));
        written.map_err(|e| super::not_json(&f.path, e))
    }

    /// Split the units into `n` shard runs of similar size (`--shard i/N`): each unit's run
    /// (1-based). Largest first, each to the lightest run so far (ties: the lowest number);
    /// names (as Python orders them) break ties of size, so every machine computes the same
    /// split.
    pub fn assign_shards(&self, n: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.units.len()).collect();
        let key = |&i: &usize| {
            let u = &self.units[i];
            (std::cmp::Reverse(u.size), manifest::name_str(&u.rel))
        };
        order.sort_by_cached_key(key);
        let mut loads = vec![0u64; n];
        let mut owner = vec![0; self.units.len()];
        for i in order {
            let k = (0..n).min_by_key(|&k| (loads[k], k)).unwrap_or(0);
            loads[k] += self.units[i].size;
            owner[i] = k + 1;
        }
        owner
    }

    /// Unit `i`'s inputs as its manifest entry names them.
    fn inputs(&self, i: usize) -> Vec<Input<'_>> {
        (self.units[i].inputs.iter())
            .map(|&k| {
                let f = &self.plan.weights[k];
                Input {
                    rel: &f.rel,
                    size: f.size,
                    mtime_ns: f.mtime_ns,
                    hash: &self.hashes[k],
                }
            })
            .collect()
    }

    /// What `resume` and `finalize` need to trust unit `i`, written at `out` by a run with
    /// `options` (as one of `shards` shard runs).
    pub fn entry(
        &self,
        i: usize,
        options: &Node<'_>,
        shards: Option<u64>,
        out: &Path,
    ) -> Result<Node<'static>> {
        let header = manifest::header_sha256(out)?;
        Ok(manifest::unit_entry(
            &self.inputs(i),
            options,
            shards,
            &header,
        ))
    }

    /// The entry of `entries` that shows `out` is unit `i` written with `options`, if one
    /// does: its inputs unchanged, the header recorded, and (where the plan knows it exactly:
    /// not a whole file's) the planned header.
    pub fn find_entry<'e>(
        &self,
        i: usize,
        entries: &'e [Node<'static>],
        options: &Node<'_>,
        out: &Path,
    ) -> Result<Option<&'e Node<'static>>> {
        let u = &self.units[i];
        let inputs = self.inputs(i);
        let planned = (!u.whole).then_some(u.header_sha256.as_str());
        let mut written: Option<String> = None;
        for e in entries {
            let Some(recorded) = manifest::unit_matches(e, &inputs, options, planned) else {
                continue;
            };
            if written.is_none() {
                written = Some(manifest::header_sha256(out)?);
            }
            if written
                .as_deref()
                .is_some_and(|w| !w.is_empty() && w == recorded)
            {
                return Ok(Some(e));
            }
        }
        Ok(None)
    }
}

/// The survey's questions about a plan's outputs in `dst` (`survey::Judge`), asked with the
/// run's manifest `options`.
pub struct Judged<'a> {
    pub work: &'a Work,
    pub dst: &'a Path,
    pub options: &'a Node<'a>,
}

impl survey::Judge for Judged<'_> {
    fn proof(&mut self, rel: &OsStr, kind: Kind) -> Result<Proof> {
        let (w, dst) = (self.work, self.dst);
        match kind {
            Kind::Weights | Kind::Index => w.expected(dst, rel, kind, Tuning::default()),
            Kind::Copy => {
                let copies = w.plan.copies.iter().chain(&w.plan.late_copies);
                let f = copies.into_iter().find(|f| f.rel == rel);
                Ok(f.map_or(Proof::Known(false), |f| Proof::SameAs(f.path.clone())))
            }
            Kind::Config => {
                let config = w.plan.configs.iter().find(|(f, _)| f.rel == rel);
                let Some((f, content)) = config else {
                    return Ok(Proof::Known(false));
                };
                if w.fp8() && super::is_model_config(rel) {
                    // (Unknown when the shards there cannot tell.)
                    let text = w.config_text(dst, rel).ok().flatten();
                    return Ok(text.map_or(Proof::Known(false), |t| Proof::Bytes(t.into_bytes())));
                }
                Ok(match content {
                    Some(c) => Proof::Bytes(c.clone().into_bytes()),
                    None => Proof::SameAs(f.path.clone()),
                })
            }
        }
    }

    fn done(&mut self, rel: &OsStr, entries: &[Node<'static>]) -> Result<bool> {
        let Some(i) = self.work.units.iter().position(|u| u.rel == rel) else {
            return Ok(false);
        };
        let out = self.dst.join(rel);
        Ok(self
            .work
            .find_entry(i, entries, self.options, &out)?
            .is_some())
    }
}

#[cfg(test)]
mod tests;
