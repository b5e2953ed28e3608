//! A prepared folder run written (`ConvertFolderTask`, stepped): its units converted one after
//! another (each with all cores), then the publish phase (`finish::Publish`), the manifests'
//! end, and the report (`finish::FolderReport`).
//!
//! In order: the failpoint `folder-checked` (every refusal is behind), the run's manifest
//! (`publish::Writer`), the units done already recorded, DST and its folders made and the
//! manifest saved (`folder-manifest`), the old indexes and configs this run makes wrong
//! withdrawn, then per unit: still this run's folder, its conversion (`Work::task`), sealed,
//! claimed in the manifest (`folder-sealed`), then, in a step of its own (a stop between them
//! publishes nothing), published (`folder-published`), recorded (`folder-file`). A whole run
//! then copies, writes the configs and indexes and re-checks (`finish::Publish`) and removes
//! the shards of another cut; a shard run re-checks its files. Last `folder-complete`, and the
//! manifests removed (a whole run) or saved complete (a shard run).
//!
//! A failure converting a unit rolls back what the run added, unless `--resume` can go on
//! from it (`publish::Writer::failed`): the caller tells a stop request first (`failed`).

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::time::Instant;

use super::finish::{self, Converted, FileRow, FolderReport, Publish};
use super::prepare::Prepared;
use crate::convert::{Report, Tuning};
use crate::error::{Error, Result, Warning};
use crate::given::{Given, Settings};
use crate::run::manifest::Manifest;
use crate::run::publish::{WeightMap, Writer};
use crate::task::{ConvertTask, Task};
use crate::vocab::WarningKind;

use crate::task::Said;

/// The steps of a `ConvertFolderTask`.
enum Stage {
    /// The failpoint `folder-checked`, the units done already recorded.
    Checked,
    /// DST and its folders made, the manifest saved.
    Begin,
    /// The failpoint `folder-manifest`, the old indexes and configs withdrawn.
    Manifest,
    /// Unit `todo[k]`: still this run's folder.
    Unit(usize),
    /// Its conversion made.
    Start(usize),
    Converting(usize, Box<ConvertTask>),
    /// Converted: sealed and claimed.
    Seal(usize, Box<ConvertTask>),
    /// Claimed: published and recorded.
    Publish(usize, Box<ConvertTask>),
    Publishing(Box<Publish>),
    /// The stale shards removed (or a shard run's files re-checked), `folder-complete`, the
    /// manifests' end.
    End,
    Done,
}

/// A prepared folder run's writing, stepped (a unit's conversion a window at a time, each
/// other write a step); `finish` gives the report.
pub struct ConvertFolderTask {
    p: Prepared,
    started: Instant,
    /// The call's `threads` and tuning (the rest is the plan's).
    threads: Option<Given>,
    tuning: Tuning,
    writer: Writer,
    stage: Stage,
    rows: Vec<FileRow>,
    converted: Vec<Converted>,
    said: Vec<Said>,
    told: usize,
    /// Bytes done: the units' tensor bytes converted, and in all (with the copies').
    done: u64,
    total: u64,
    /// The file in progress: (rel, done, total).
    file: Option<(OsString, u64, u64)>,
    /// The last step worked on a unit's conversion: its failure may roll the run back.
    converting: bool,
    /// The unit in progress measures its numerics.
    measured: bool,
}

impl ConvertFolderTask {
    /// The writing of `p`, its units converted with `threads` and `tuning`.
    pub fn new(p: Prepared, threads: Option<Given>, tuning: Tuning) -> ConvertFolderTask {
        let s = &p.survey.manifests;
        let own = s.own.as_ref().and_then(|m| m.published);
        let mut m = Manifest::new(
            &p.src,
            p.src_id,
            &p.dst,
            p.options.clone(),
            Some(p.allow_quantized),
            p.shard,
            p.mine.clone(),
        );
        // The manifest at this run's name that the survey read (resume, force) is the one to
        // replace, still that file; with none there, another run's appearing meanwhile is
        // not. Under force: what the survey found at this name, and nothing else: a manifest
        // that appeared since is a rival run's.
        m.published = own;
        m.first_replace = s.at_own_name.filter(|_| p.force && own.is_none());
        // What `force` lets this run (and its `--resume`) replace as found: the files the
        // plan writes, but other shard runs' units (a shard run's copies, configs and
        // indexes are for its `finalize`).
        let own: HashSet<usize> = p.units.iter().copied().collect();
        let others: HashSet<&OsString> = (0..p.work.units.len())
            .filter(|k| !own.contains(k))
            .map(|k| &p.work.units[k].rel)
            .collect();
        let writes: HashSet<OsString> = (p.work.outputs().into_iter())
            .map(|(rel, _, _)| rel)
            .filter(|rel| !others.contains(rel))
            .collect();
        let mut writer = Writer::new(m, s.ours.clone(), s.found.clone(), p.force);
        writer.writes = writes;
        let units = p.todo.iter().map(|&k| p.work.units[k].data_bytes);
        let total = units.sum::<u64>() + p.copies.iter().map(|f| f.size).sum::<u64>();
        ConvertFolderTask {
            p,
            started: Instant::now(),
            threads,
            tuning,
            writer,
            stage: Stage::Checked,
            rows: Vec::new(),
            converted: Vec::new(),
            said: Vec::new(),
            told: 0,
            done: 0,
            total,
            file: None,
            converting: false,
            measured: false,
        }
    }

    /// The report, once every step is done, and the units this run converted (their
    /// numerics rows are their reports').
    pub fn finish(self) -> (FolderReport, Vec<Converted>) {
        let p = &self.p;
        let said = finish::Said {
            src: p.src.clone(),
            dst: p.dst.clone(),
            to: p.target,
            started: self.started,
            shard: p.shard,
            complete: p.shard.is_none(),
            on_overflow: p.on_overflow,
            max_shard_size: p.work.max_size,
            first: p.warnings.clone(),
        };
        let report = FolderReport::new(said, self.rows, &self.converted);
        (report, self.converted)
    }

    /// The path a unit's warnings name, and whether a warning of `kind` is told: a whole
    /// file's name its input, an output shard's the shard. An output shard of integer or BF16
    /// tensors only is no surprise; a prefix to strip was judged over the whole input by the
    /// plan, and so were a re-sharded group's transposed experts (its plan named them all).
    fn said_of(&self, i: usize, kind: WarningKind) -> Option<OsString> {
        let w = &self.p.work;
        let u = &w.units[i];
        let whole = !matches!(
            kind,
            WarningKind::NothingToConvert | WarningKind::TransposedExperts
        );
        let told = (u.whole || whole) && kind != WarningKind::UnmatchedPrefix;
        told.then(|| match u.whole {
            true => w.plan.weights[u.inputs[0]].source_rel().to_os_string(),
            false => u.rel.clone(),
        })
    }

    fn tell(&mut self, i: usize, warnings: Vec<Warning>) {
        for w in warnings {
            if let Some(at) = self.said_of(i, w.kind) {
                self.said.push((w, Some(at)));
            }
        }
    }

    /// Unit `i`'s conversion into its output, replacing only what this run may.
    fn start(&mut self, i: usize) -> Result<ConvertTask> {
        let (w, rel) = (&self.writer, &self.p.work.units[i].rel);
        let replaces = w.replace_for(rel);
        let dst = w.out_path(rel)?;
        let s = Settings {
            threads: self.threads.clone(),
            ..self.p.work.settings(i)
        };
        let mut opts = s.shard_convert(self.tuning.clone())?;
        (opts.replaces, opts.force) = (replaces, replaces.is_some());
        self.measured = opts.numerics;
        self.p.work.task(i, &dst, &opts)
    }

    /// Unit `i` published: its report (a whole file's bytes in are its input's) and the
    /// warnings it tells.
    fn published(&mut self, i: usize, mut report: Report, measured: bool) -> Converted {
        let u = &self.p.work.units[i];
        report.bytes_in = u.input_bytes;
        let warnings = std::mem::take(&mut report.warnings);
        let warnings = (warnings.into_iter())
            .filter_map(|w| Some((w.clone(), Some(self.said_of(i, w.kind)?))))
            .collect();
        Converted {
            rel: u.rel.clone(),
            report,
            warnings,
            measured,
        }
    }

    fn step_unit(&mut self, budget: u64) -> Result<Stage> {
        let todo = &self.p.todo;
        let stage = std::mem::replace(&mut self.stage, Stage::Done);
        self.converting = matches!(
            stage,
            Stage::Start(_) | Stage::Converting(..) | Stage::Seal(..) | Stage::Publish(..)
        );
        Ok(match stage {
            Stage::Unit(k) => match todo.get(k) {
                Some(&i) => {
                    // Not into a folder another run took over since (it would replace its
                    // files).
                    self.writer.record.check_still_ours()?;
                    let u = &self.p.work.units[i];
                    self.file = Some((u.rel.clone(), 0, u.data_bytes));
                    Stage::Start(k)
                }
                None => self.after_units()?,
            },
            Stage::Start(k) => {
                let task = self.start(todo[k]).map_err(|e| self.writer.rival(e))?;
                self.file_of(k, &task);
                Stage::Converting(k, Box::new(task))
            }
            Stage::Converting(k, mut task) => {
                let done = task.step(budget).map_err(|e| self.writer.rival(e))?;
                let said = task.take_warnings();
                self.tell(todo[k], said);
                self.file_of(k, &task);
                match done {
                    true => Stage::Seal(k, task),
                    false => Stage::Converting(k, task),
                }
            }
            Stage::Seal(k, mut task) => {
                let rel = self.p.work.units[todo[k]].rel.clone();
                task.seal().map_err(|e| self.writer.rival(e))?;
                let said = task.take_warnings();
                self.tell(todo[k], said);
                // The manifest claims the output before it has a name.
                let id = crate::output::Sealed::identity(&*task)?;
                let header = crate::output::Sealed::header_sha256(&*task);
                (self.writer.claim_as(&rel, id, header)).map_err(|e| self.writer.rival(e))?;
                finish::failpoint("folder-sealed")?;
                Stage::Publish(k, task)
            }
            Stage::Publish(k, task) => {
                let i = todo[k];
                let measured = self.measured;
                let report = task.publish().map_err(|e| self.writer.rival(e))?;
                let u = &self.p.work.units[i];
                let (rel, data) = (u.rel.clone(), u.data_bytes);
                self.file = Some((rel.clone(), data, data));
                self.done += data;
                let converted = self.published(i, report, measured);
                self.converting = false;
                // The output has its name; the manifest does not say so yet.
                finish::failpoint("folder-published")?;
                let shards = self.p.shard.map(|(_, n)| n);
                let out = self.p.dst.join(&rel);
                let entry = self.p.work.entry(i, &self.p.options, shards, &out)?;
                self.writer.published(&rel, "weights", None, Some(&entry))?;
                self.writer.record.save()?;
                self.rows
                    .push(FileRow::converted(&self.p.work, i, &converted));
                self.converted.push(converted);
                finish::failpoint("folder-file")?;
                Stage::Unit(k + 1)
            }
            other => other,
        })
    }

    /// Unit `todo[k]`'s progress, as its conversion tells it.
    fn file_of(&mut self, k: usize, task: &ConvertTask) {
        let rel = self.p.work.units[self.p.todo[k]].rel.clone();
        let (done, total) = task.progress();
        self.file = Some((rel, done, total));
    }

    /// Every unit written: a whole run's publish phase, else a shard run's end.
    fn after_units(&mut self) -> Result<Stage> {
        Ok(match self.p.shard {
            None => Stage::Publishing(Box::new(Publish::new(&self.p.work))),
            Some(_) => Stage::End,
        })
    }
}

impl Task for ConvertFolderTask {
    fn step(&mut self, budget: u64) -> Result<bool> {
        self.converting = false;
        let next = match &mut self.stage {
            Stage::Checked => {
                // Every refusal is behind us: from here on, files are written.
                finish::failpoint("folder-checked")?;
                let shards = self.p.shard.map(|(_, n)| n);
                for &i in &self.p.skipped {
                    let rel = &self.p.work.units[i].rel;
                    let out = self.p.dst.join(rel);
                    let entry = self.p.work.entry(i, &self.p.options, shards, &out)?;
                    let id = self.writer.record.identity(rel)?;
                    self.writer.record.record(rel, "weights", id, Some(&entry));
                    self.rows
                        .push(FileRow::unit(&self.p.work, i, "skipped", id.2));
                }
                Stage::Begin
            }
            Stage::Begin => {
                // Before any output: DST and the folders it writes into made, and the
                // manifest saved, so that the other runs sharing this folder know it is ours
                // (refused if another run started meanwhile). What DST holds now is what a
                // failed run keeps.
                let w = &self.p.work;
                let outputs = w.outputs().into_iter().map(|(rel, _, _)| rel);
                let dirs = w.plan.dirs.iter().map(|d| {
                    let mut rel = d.clone();
                    rel.push("/x");
                    rel
                });
                let rels: Vec<OsString> = outputs.chain(dirs).collect();
                let m = &self.p.survey.manifests;
                self.writer.make_folders(&rels)?;
                let stale = self.writer.remove_stale_temps(&rels);
                self.said.extend(stale.into_iter().map(|w| (w, None)));
                let before: HashSet<OsString> = m.present.iter().cloned().collect();
                self.writer.begin(before, m.at_own_name.is_some())?;
                Stage::Manifest
            }
            Stage::Manifest => {
                finish::failpoint("folder-manifest")?;
                if self.p.shard.is_none() {
                    // Before anything in DST changes: the old indexes this run would make
                    // inconsistent, and the old model configs that would describe its weights
                    // wrongly.
                    let w = &self.p.work;
                    let maps: Vec<(OsString, WeightMap)> = (w.index_maps().into_iter())
                        .map(|(rel, _, map)| (rel.to_os_string(), map.iter().cloned().collect()))
                        .collect();
                    let todo = self.p.todo.iter().map(|&i| w.units[i].rel.clone());
                    let writes: HashSet<OsString> = todo.collect();
                    let withdraw = &self.p.survey.withdraw;
                    self.writer.unpublish(&maps, &writes, withdraw)?;
                }
                Stage::Unit(0)
            }
            Stage::Publishing(publish) => {
                let (work, w) = (&self.p.work, &mut self.writer);
                if publish.step(work, w, budget)? {
                    self.done += publish.progress().1;
                    // (The last file told stays the last copy.)
                    if let Some((rel, done, total)) = publish.file() {
                        self.file = Some((rel.to_os_string(), done, total));
                    }
                    self.rows.extend(std::mem::take(&mut publish.rows));
                    // The new indexes name none of them: only now may the shards of another
                    // cut go.
                    w.remove_stale(&self.p.survey.stale)?;
                    Stage::End
                } else {
                    return Ok(false);
                }
            }
            Stage::End => {
                if self.p.shard.is_some() {
                    self.writer.recheck(&[])?;
                }
                finish::failpoint("folder-complete")?;
                match self.p.shard {
                    // Done: no stcast file stays behind (this source's shard manifests
                    // neither).
                    None => self.writer.remove_own(&self.p.survey.manifests.siblings)?,
                    Some(_) => {
                        self.writer.record.complete = true;
                        self.writer.record.save()?;
                    }
                }
                Stage::Done
            }
            Stage::Done => return Ok(true),
            _ => self.step_unit(budget)?,
        };
        self.stage = next;
        Ok(matches!(self.stage, Stage::Done))
    }

    fn progress(&self) -> (u64, u64) {
        let current = match (&self.stage, &self.file) {
            (Stage::Publishing(p), _) => p.progress().0,
            (Stage::Converting(..) | Stage::Seal(..) | Stage::Publish(..), Some(f)) => f.1,
            _ => 0,
        };
        ((self.done + current).min(self.total), self.total)
    }

    /// The warnings said since the last call, each with the path it names.
    fn take_said(&mut self) -> Vec<Said> {
        let new = self.said[self.told..].to_vec();
        self.told = self.said.len();
        new
    }

    /// A unit's conversion that fails rolls back what the run added, unless `--resume` can
    /// go on from it (`publish::Writer::failed`).
    fn failed(&mut self, e: Error) -> Error {
        match self.converting {
            true => self.writer.failed(e),
            false => e,
        }
    }

    fn file_progress(&self) -> Option<(&OsStr, u64, u64)> {
        if let Stage::Publishing(p) = &self.stage {
            if let Some(f) = p.file() {
                return Some(f);
            }
        }
        let (rel, done, total) = self.file.as_ref()?;
        Some((rel, *done, *total))
    }
}

#[cfg(test)]
mod tests;
