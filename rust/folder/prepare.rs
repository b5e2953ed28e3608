//! A folder run prepared: every check it makes before anything is written, in order, and
//! what it will write (`Prepared`, made by `PrepareTask`, stepped).
//!
//! In order: the shard range's form, where the run reads and writes (`run::place`), the
//! source's plan (`WorkTask`: a folder, or re-sharded also one checkpoint, with its model
//! `config`), the shard range against the units, the keep patterns judged over the whole
//! folder (a warning, or under `strict` a refusal), the prefixes to strip, the FP8 side
//! config's notice, the files left out, the walk's warnings, that something changes
//! (`Work::check`), the plan's warnings, `--shard`'s split, what the destination holds and
//! whether the run may write there (`run::survey`), the files it leaves out that DST holds,
//! and last, over an earlier output, the inputs read for overflow first (a refusal while
//! converting a later file would come after earlier ones were replaced). A dry run with a
//! destination makes exactly these checks.
//!
//! Each check that may refuse comes first in its step, so that a caller who tells the
//! warnings between steps (`take_said`) has told every warning said before the refusal.

use std::borrow::Cow;
use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::inspect::Said;
use super::skipped_notes;
use super::work::{Cut, Judged, Work, WorkTask};
use crate::convert::Tuning;
use crate::error::{side_config_notice, unmatched_message, Error, Result, Warning};
use crate::given::{Settings, ShardGiven};
use crate::naming::split_rel;
use crate::options::{Role, DEFS};
use crate::run::beside::FOLDER_SIDE_CONFIG;
use crate::run::json::{Node, Str, Value};
use crate::run::manifest::{self, Shard};
use crate::run::place::{self, Ident, SourceKind};
use crate::run::survey::{self, Answer};
use crate::run::walk::File;
use crate::task::{InspectTask, Task};
use crate::text::name_list;
use crate::vocab::{OnOverflow, OptionName, Target, Unmatched, WarningKind};

/// Files named in the warning of those DST holds that the run leaves out.
const SHOWN: usize = 8;

/// What a folder run is asked.
#[derive(Debug, Clone)]
pub struct Asked {
    pub src: PathBuf,
    /// None: the default destination, named after `src`.
    pub dst: Option<PathBuf>,
    /// `to`, the options that decide what each tensor becomes and how the source is read,
    /// and `force`, `allow_quantized`, `follow_links`, `name`, `config`, `strict` (a keep
    /// pattern that matches no tensor is refused, not warned of), `max_shard_size`,
    /// `shard`, `resume`.
    pub settings: Settings,
}

impl Asked {
    /// The run of `src` into `dst` with the options `s` (its `threads` and `report` are the
    /// writing's).
    pub fn new(src: &Path, dst: Option<&Path>, s: &Settings) -> Asked {
        let settings = Settings {
            threads: None,
            report: None,
            ..s.clone()
        };
        Asked {
            src: src.to_path_buf(),
            dst: dst.map(Path::to_path_buf),
            settings,
        }
    }
}

/// A folder run with every check made and nothing written yet.
pub struct Prepared {
    /// The source read (a cache repo root's snapshot).
    pub src: PathBuf,
    pub dst: PathBuf,
    pub src_id: Ident,
    pub target: Target,
    /// The plan of the run's output units (shared with a front end's view of it).
    pub work: Arc<Work>,
    /// The options that change the output, as the run's manifest records them (the defaults
    /// left out, so that plain runs' manifests stay as they were).
    pub options: Node<'static>,
    pub shard: Option<Shard>,
    /// This run's units (all, or the shard's), in `Work::units`.
    pub units: Vec<usize>,
    /// The files this run writes (its units' under `shard`), sorted as a manifest lists them.
    pub mine: Vec<OsString>,
    /// What the destination holds, as far as this run is concerned.
    pub survey: Answer,
    /// This run's units still to write, and those done already (`resume`).
    pub todo: Vec<usize>,
    pub skipped: Vec<usize>,
    /// The files copied (none for a shard run: `finalize` copies them).
    pub copies: Vec<File>,
    /// Every warning the checks said, in order, each with the source file it is about.
    pub warnings: Vec<Said>,
    /// The options the writing reads besides the plan's.
    pub force: bool,
    pub allow_quantized: bool,
    pub on_overflow: OnOverflow,
}

/// The steps of a `PrepareTask`.
enum Stage {
    /// The source's plan, a weight file or a group a step.
    Plan(Box<WorkTask>),
    /// The shard range, the keep patterns and what the plan found of the folder.
    Said,
    /// That something changes, the plan's warnings, `--shard`'s split.
    Checked,
    /// What the destination holds.
    Survey,
    /// Read the inputs of the units to write for overflow, one a step.
    Overflow(usize, Option<Box<InspectTask>>),
    Done,
}

/// The checks of a folder run, stepped (a weight file, a group or a read a step, and each
/// check that may refuse first in its own); `finish` gives the `Prepared` run.
pub struct PrepareTask {
    asked: Asked,
    stage: Stage,
    src: PathBuf,
    dst: PathBuf,
    src_id: Ident,
    target: Target,
    shard: Option<Shard>,
    work: Option<Work>,
    options: Option<Node<'static>>,
    units: Vec<usize>,
    mine: Vec<OsString>,
    survey: Option<Answer>,
    todo: Vec<usize>,
    skipped: Vec<usize>,
    /// The inputs read for overflow first.
    reads: Vec<PathBuf>,
    warnings: Vec<Said>,
    /// How many of `warnings` were taken (`take_said`).
    told: usize,
}

impl PrepareTask {
    /// Check the shard range's form and where the run reads and writes, and start the
    /// source's plan.
    pub fn new(asked: Asked) -> Result<PrepareTask> {
        let s = &asked.settings;
        let target = s.target()?;
        let shard = s.shard.as_ref().map(check_shard).transpose()?;
        let max_shard_size = s.max_shard_size()?;
        let resharding = max_shard_size.is_some();
        // The default DST is named after what was given: beside a cache repo root, never
        // inside the cache's snapshots/.
        let at = place::place(&asked.src, asked.dst.as_deref(), target, resharding, true)?;
        // Re-sharded, one checkpoint (a file, a DCP or ZeRO folder) makes a folder, its
        // model `config` beside it; its links read as the walk reads a folder's.
        let single = resharding && place::source(&at.src, true)? != SourceKind::Tree;
        let plan = Settings {
            force: false,
            allow_quantized: None,
            // (The keep patterns are judged over the whole folder: `said`.)
            strict: false,
            name: s.name.clone().filter(|_| resharding),
            config: s.config.clone().filter(|_| single),
            ..s.clone()
        };
        let cut = max_shard_size.map(|max_size| Cut {
            max_size,
            follow_links: s.follow_links,
            ..Cut::default()
        });
        let check_quantized = !s.allow_quantized.unwrap_or(false);
        let task = WorkTask::new(&at.src, &plan, check_quantized, single, cut, None)?;
        Ok(PrepareTask {
            asked,
            stage: Stage::Plan(Box::new(task)),
            src: at.src,
            dst: at.dst,
            src_id: at.id,
            target,
            shard,
            work: None,
            options: None,
            units: Vec::new(),
            mine: Vec::new(),
            survey: None,
            todo: Vec::new(),
            skipped: Vec::new(),
            reads: Vec::new(),
            warnings: Vec::new(),
            told: 0,
        })
    }

    fn say(&mut self, w: Warning, at: Option<OsString>) {
        self.warnings.push((w, at));
    }

    fn work(&self) -> &Work {
        self.work
            .as_ref()
            .unwrap_or_else(|| unreachable!("planned first"))
    }

    /// The shard range, the keep patterns (judged over the whole folder: one warning, or
    /// under `strict` one refusal, for a pattern that matches no tensor of any file), the
    /// prefixes to strip (a re-sharding's plan judged them over its groups), the FP8 side
    /// config's notice (a shard run's is `finalize`'s), the files left out, the walk's
    /// warnings.
    fn said(&mut self) -> Result<()> {
        let w = self.work();
        if let Some((i, n)) = self.shard {
            if n > w.units.len() as u64 {
                let given = self.asked.settings.shard.as_ref();
                return Err(Error::ShardRange {
                    given: given.map_or_else(|| format!("{i}/{n}"), |g| g.numbers.clone()),
                    max: w.units.len(),
                    noun: w.noun(),
                });
            }
        }
        let unmatched = w.plan.keep_unmatched.clone();
        if !unmatched.is_empty() && self.asked.settings.strict {
            let (path, patterns) = (self.src.clone(), unmatched);
            return Err(Error::UnmatchedPatterns { path, patterns });
        }
        let mut said = Vec::new();
        if !unmatched.is_empty() {
            let text = unmatched_message(&unmatched);
            said.push(Warning::new(WarningKind::UnmatchedPattern, text));
        }
        if w.max_size.is_none() {
            said.extend(w.plan.unmatched_prefixes.iter().cloned());
        }
        let side = (w.plan.configs.iter())
            .find(|(f, _)| split_rel(f.rel.as_bytes()).1 == FOLDER_SIDE_CONFIG.as_bytes());
        if let (Some((f, _)), None) = (side, self.shard) {
            said.push(side_config_notice(&self.dst.join(&f.rel)));
        }
        said.extend(skipped_notes(&w.plan.skipped));
        said.extend(w.plan.walk_warnings.iter().cloned());
        for w in said {
            self.say(w, None);
        }
        Ok(())
    }

    /// That something changes (a plain run that writes a copy of the folder is refused),
    /// what a re-sharding's plan said, the manifest's options, and `--shard`'s split.
    fn checked(&mut self) -> Result<()> {
        let w = self.work();
        w.check(&self.src)?;
        w.copies_open()?;
        let said = w.warnings.clone();
        let options = run_options(&self.asked.settings, self.target, w)?;
        let all = 0..w.units.len();
        let units: Vec<usize> = match self.shard {
            Some((i, n)) => {
                let owner = w.assign_shards(n as usize);
                all.filter(|&k| owner[k] as u64 == i).collect()
            }
            None => all.collect(),
        };
        let mut mine: Vec<OsString> = match self.shard {
            Some(_) => units.iter().map(|&k| w.units[k].rel.clone()).collect(),
            None => w.outputs().into_iter().map(|(rel, _, _)| rel).collect(),
        };
        mine.sort_by_cached_key(|rel| manifest::name_str(rel));
        for (n, at) in said {
            self.say(n, at);
        }
        (self.options, self.units, self.mine) = (Some(options), units, mine);
        Ok(())
    }

    /// No output is a file of the source, what the destination holds, what this run may
    /// replace, which of its units are done (skipped under `resume`), room for the rest, and
    /// no leftover a loader would take for the output (`run::survey`). Then the files this
    /// run leaves out that DST holds (an earlier run's copies): they stay, as everything it
    /// does not write, but make DST more than this run's output.
    fn surveyed(&mut self) -> Result<()> {
        let w = self
            .work
            .as_ref()
            .unwrap_or_else(|| unreachable!("planned first"));
        let options = self.options.as_ref().unwrap_or_else(|| unreachable!());
        let planned = w.outputs().into_iter();
        let planned = planned.map(|(rel, kind, size)| survey::Planned { rel, kind, size });
        let renamed = w.groups.iter().filter_map(|g| g.renamed.clone());
        let q = survey::Question {
            asked: manifest::Asked {
                src_id: self.src_id,
                shard: self.shard,
                options,
                force: self.asked.settings.force,
                resume: self.asked.settings.resume,
            },
            outputs: planned.collect(),
            room: Some(survey::Room {
                src: self.src.clone(),
                sources: w.plan.sources(),
                mine: self.units.iter().map(|&k| w.units[k].rel.clone()).collect(),
                inputs: w.plan.weights.iter().map(|f| f.path.clone()).collect(),
                renamed: renamed.collect(),
            }),
        };
        let mut judge = Judged {
            work: w,
            dst: &self.dst,
            options,
        };
        let answer = survey::survey(&self.dst, &q, &mut judge)?;
        // (Sets: a folder may hold many thousand files.)
        let adopted: HashSet<&OsString> = answer.skipped.iter().collect();
        let done = |k: &usize| adopted.contains(&w.units[*k].rel);
        (self.skipped, self.todo) = self.units.iter().partition(|k| done(k));
        let present: HashSet<&OsStr> = (answer.manifests.present.iter())
            .map(OsString::as_os_str)
            .collect();
        let there: Vec<String> = (w.plan.skipped.iter())
            .map(|(f, _)| f.source_rel())
            .filter(|r| present.contains(r))
            .map(|r| r.to_string_lossy().into_owned())
            .collect();
        let m = &answer.manifests;
        let replaces = !m.ours.is_empty() || (self.asked.settings.force && !m.found.is_empty());
        if replaces && self.reads_first()? {
            let mut reads: Vec<PathBuf> = Vec::new();
            for &k in &self.todo {
                for &i in &w.units[k].inputs {
                    let path = &w.plan.weights[i].path;
                    if !reads.contains(path) {
                        reads.push(path.clone());
                    }
                }
            }
            self.reads = reads;
        }
        self.survey = Some(answer);
        if !there.is_empty() {
            let text = format!(
                "DST holds {}, which this run leaves out and does not delete: verify fails \
                 the output while it is there (remove it, or {{include}} it)",
                name_list(there.iter().map(String::as_str), SHOWN)
            );
            self.say(Warning::new(WarningKind::SkippedFiles, text), None);
        }
        Ok(())
    }

    /// Whether the inputs are read for overflow before an earlier output is replaced: under
    /// `on_overflow` error for any overflow, under keep for a dequantized weight's (a
    /// re-sharding's plan read for those already).
    fn reads_first(&self) -> Result<bool> {
        let resharding = self.asked.settings.max_shard_size.is_some();
        Ok(match self.asked.settings.on_overflow()? {
            OnOverflow::Warn => false,
            OnOverflow::Keep => !resharding,
            OnOverflow::Error => true,
        })
    }

    /// The read of input `path` as `inspect --dry-run` reads it, refusing what converting it
    /// would refuse.
    fn read(&self, path: &Path) -> Result<InspectTask> {
        let s = Settings {
            keep_unmatched: Unmatched::Ignore,
            allow_quantized: Some(true),
            force: false,
            follow_links: false,
            name: None,
            config: None,
            ..self.asked.settings.clone()
        };
        let scan = s.on_overflow()? == OnOverflow::Error;
        let opts = s.inspect(Tuning::default(), false)?;
        InspectTask::new(path, scan, &opts, None)
    }

    /// The run, once every step is done.
    pub fn finish(self) -> Result<Prepared> {
        let (Some(work), Some(options), Some(survey)) = (self.work, self.options, self.survey)
        else {
            unreachable!("finish before the last step");
        };
        let copies = match self.shard {
            Some(_) => Vec::new(),
            None => work.plan.copies.clone(),
        };
        Ok(Prepared {
            src: self.src,
            dst: self.dst,
            src_id: self.src_id,
            target: self.target,
            work: Arc::new(work),
            options,
            shard: self.shard,
            units: self.units,
            mine: self.mine,
            survey,
            todo: self.todo,
            skipped: self.skipped,
            copies,
            warnings: self.warnings,
            force: self.asked.settings.force,
            allow_quantized: self.asked.settings.allow_quantized.unwrap_or(false),
            on_overflow: self.asked.settings.on_overflow()?,
        })
    }
}

impl Task for PrepareTask {
    fn step(&mut self, budget: u64) -> Result<bool> {
        match &mut self.stage {
            Stage::Plan(task) => {
                if task.step(budget)? {
                    let Stage::Plan(task) = std::mem::replace(&mut self.stage, Stage::Said) else {
                        unreachable!()
                    };
                    self.work = Some(task.finish()?);
                }
            }
            Stage::Said => {
                self.said()?;
                self.stage = Stage::Checked;
            }
            Stage::Checked => {
                self.checked()?;
                self.stage = Stage::Survey;
            }
            Stage::Survey => {
                self.surveyed()?;
                self.stage = Stage::Overflow(0, None);
            }
            Stage::Overflow(i, current) => {
                let i = *i;
                match current {
                    Some(task) => {
                        if task.step(budget)? {
                            let Stage::Overflow(_, Some(task)) =
                                std::mem::replace(&mut self.stage, Stage::Overflow(i + 1, None))
                            else {
                                unreachable!()
                            };
                            task.finish()?;
                        }
                    }
                    None if i < self.reads.len() => {
                        let task = self.read(&self.reads[i])?;
                        self.stage = Stage::Overflow(i, Some(Box::new(task)));
                    }
                    None => self.stage = Stage::Done,
                }
            }
            Stage::Done => {}
        }
        Ok(matches!(self.stage, Stage::Done))
    }

    /// (The checks read headers, and inputs only over an earlier output: no progress told.)
    fn progress(&self) -> (u64, u64) {
        (0, 0)
    }

    /// The warnings said since the last call, each with the source file it is about.
    fn take_said(&mut self) -> Vec<Said> {
        let new = self.warnings[self.told..].to_vec();
        self.told = self.warnings.len();
        new
    }
}

/// `shard` as a run splits: (i, n) with 1 <= i <= n.
fn check_shard(given: &ShardGiven) -> Result<Shard> {
    let bad = || Error::BadOption {
        option: OptionName::Shard,
        value: given.repr.clone(),
        expected: "a pair (i, n) of whole numbers with 1 <= i <= n".into(),
    };
    match given.parts {
        Some((i, n)) if 1 <= i && i <= n => {
            let whole = |x: i128| u64::try_from(x).unwrap_or(u64::MAX);
            Ok((whole(i), whole(n)))
        }
        _ => Err(bad()),
    }
}

/// The options of a run that change its output, as its manifest records them: `to`, those
/// that decide what each tensor becomes and how the source is read (each in the options'
/// table order, left out at its default, a flag recorded as true), a re-sharding's size and
/// `name` (another name is another output, as another size is: under resume, the files a
/// manifest proves this source's that the plan no longer writes are stale).
fn run_options(s: &Settings, target: Target, w: &Work) -> Result<Node<'static>> {
    let text = |t: &str| node(Value::Str(Str::Text(Cow::Owned(t.into()))));
    let texts = |v: &[String]| node(Value::Array(v.iter().map(|t| text(t)).collect()));
    let number = |n: u64| node(Value::Number(Cow::Owned(n.to_string())));
    let on = node(Value::Literal("true"));
    let mut members = vec![("to", text(target.name()))];
    let roles = [Role::Precision, Role::Source];
    for def in roles
        .iter()
        .flat_map(|r| DEFS.iter().filter(move |d| d.role == *r))
    {
        let value = match def.name {
            "keep" if !s.keep.is_empty() => texts(&s.keep),
            "keep_min_size" => match s.keep_min_size.as_ref() {
                Some(g) => match g.whole(OptionName::KeepMinSize, u64::MAX)? {
                    0 => continue,
                    n => number(n),
                },
                None => continue,
            },
            "from_bf16" if s.from_bf16 => on.clone(),
            "on_overflow" => match s.on_overflow()? {
                OnOverflow::Warn => continue,
                o => text(o.name()),
            },
            "include" if !s.include.is_empty() => texts(&s.include),
            "exclude" if !s.exclude.is_empty() => texts(&s.exclude),
            "no_record" if s.no_record => on.clone(),
            "key" => match &s.key {
                Some(k) => text(k),
                None => continue,
            },
            "strip_prefix" if !s.strip_prefix.is_empty() => texts(&s.strip_prefix),
            _ => continue,
        };
        members.push((def.name, value));
    }
    if let Some(size) = w.max_size {
        members.push(("max_shard_size", number(size)));
        if let Some(name) = &s.name {
            members.push(("name", text(name)));
        }
    }
    let members = members.into_iter();
    let members = members.map(|(k, v)| (Str::Text(Cow::Borrowed(k)), v));
    Ok(node(Value::Object(members.collect())))
}

fn node(value: Value<'static>) -> Node<'static> {
    Node {
        value,
        span: (0, 0),
    }
}

#[cfg(test)]
mod tests;
