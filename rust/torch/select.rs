//! Choosing the state dict inside a checkpoint and flattening it to named tensors.
//!
//! Checkpoints nest: a bare `OrderedDict` of tensors, `{"state_dict": ...}`, or
//! `{"epoch": 3, "model": {...}, "ema": {...}}`. Every walk here uses an explicit stack, stops
//! at `Limits::max_depth` and visits at most `Limits::max_objects` entries, so shared or
//! cyclic dicts in a hostile pickle cannot make it recurse or run away.

use std::collections::HashMap;

use super::error::{TensorProblem, TorchError};
use super::pickle::{Dict, ObjId, Object};
use super::tensor::TensorDesc;
use super::Checkpoint;

/// A dict that holds tensors (directly or in dicts below it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDict {
    /// Dotted path from the top level (`""` for the top level itself).
    pub path: String,
    /// Tensors that are values of this dict.
    pub direct: usize,
    /// Tensors in this dict and all dicts below it.
    pub total: usize,
    /// Index (in the list) of the dict holding this one; `None` for the top level.
    pub parent: Option<usize>,
}

/// One selected tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedTensor {
    /// Its name: its dotted path below the selected dict.
    pub name: String,
    /// That path as read (the name is made from it).
    pub source: String,
    pub desc: TensorDesc,
}

/// The result of [`Checkpoint::select`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// The dotted path of the selected dict (`""`: the top level).
    pub key: String,
    /// The tensors, in the pickle's order, with dotted names for nested dicts.
    pub tensors: Vec<NamedTensor>,
    /// Names of entries at the selected level that are not tensors (left out; warn).
    pub skipped: Vec<String>,
    /// Globals outside the allow-list seen anywhere in the pickle (warn).
    pub placeholders: Vec<String>,
}

/// A dict key as Python tells keys apart (a str and an int may render alike).
/// Its str is borrowed from the pickle: no copy of every key while walking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key<'p> {
    Str(&'p str),
    Int(i64),
    Other(ObjId),
}

impl Key<'_> {
    fn name(&self) -> Option<&str> {
        match self {
            Key::Str(s) => Some(s),
            _ => None,
        }
    }
    fn render(&self, ck: &Checkpoint) -> String {
        match self {
            Key::Str(s) => s.to_string(),
            Key::Int(i) => i.to_string(),
            Key::Other(id) => format!("<{} key>", ck.pickle.get(*id).kind()),
        }
    }
    /// The key as Python subscripts it: `['a.b']`, `[1]`.
    fn subscript(&self, ck: &Checkpoint) -> String {
        match self {
            Key::Str(s) => format!("[{}]", quoted(s)),
            Key::Int(i) => format!("[{i}]"),
            Key::Other(id) => format!("[<{} key>]", ck.pickle.get(*id).kind()),
        }
    }
}

/// A str key as Python's `repr` quotes it (control characters are left to the printer,
/// which escapes them in every message).
fn quoted(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        if c == '\\' || c == quote {
            out.push('\\');
        }
        out.push(c);
    }
    out.push(quote);
    out
}

/// `path.key`, or the key alone at the top (one string made, not two).
fn join(path: &str, key: Key<'_>, ck: &Checkpoint) -> String {
    if path.is_empty() {
        return key.render(ck);
    }
    match key {
        Key::Str(s) => {
            let mut out = String::with_capacity(path.len() + 1 + s.len());
            out.push_str(path);
            out.push('.');
            out.push_str(s);
            out
        }
        _ => format!("{path}.{}", key.render(ck)),
    }
}

fn too_large(ck: &Checkpoint) -> TorchError {
    TorchError::WalkTooLarge {
        limit: ck.limits.max_objects as u64,
    }
}

/// A budget of dict entries to visit in one walk.
struct Budget(u64);

impl Budget {
    fn spend(&mut self, n: usize, ck: &Checkpoint) -> Result<(), TorchError> {
        self.0 = self.0.checked_sub(n as u64).ok_or_else(|| too_large(ck))?;
        Ok(())
    }
}

impl Checkpoint<'_> {
    fn dict(&self, id: ObjId) -> Option<&Dict> {
        match self.pickle.arena(id) {
            Some(Object::Dict(d)) => Some(d),
            _ => None,
        }
    }

    /// A dict's entries with duplicate keys resolved as Python does: the last value wins,
    /// in the place of the first.
    fn entries<'p>(&'p self, d: &'p Dict) -> Vec<(Key<'p>, ObjId)> {
        let mut out: Vec<(Key<'p>, ObjId)> = Vec::with_capacity(d.items.len());
        let mut seen: HashMap<Key<'p>, usize> = HashMap::with_capacity(d.items.len());
        for &(k, v) in &d.items {
            let key = match (self.pickle.str_of(k), &*self.pickle.get(k)) {
                (Some(s), _) => Key::Str(s),
                (_, Object::Int(i)) => Key::Int(*i),
                (_, Object::Bool(b)) => Key::Int(i64::from(*b)),
                _ => Key::Other(k),
            };
            match seen.entry(key) {
                std::collections::hash_map::Entry::Occupied(e) => out[*e.get()].1 = v,
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(out.len());
                    out.push((key, v));
                }
            }
        }
        out
    }

    /// Every dict that holds tensors, in pre-order, with its dotted path and tensor counts
    /// (for a message that lists them when the top level is not itself a state dict).
    pub fn tensor_dicts(&self) -> Result<Vec<TensorDict>, TorchError> {
        let mut all: Vec<TensorDict> = Vec::new();
        let Some(root) = self.dict(self.pickle.root) else {
            return Ok(all);
        };
        struct Frame<'p> {
            entries: Vec<(Key<'p>, ObjId)>,
            next: usize,
            index: usize,
        }
        let mut budget = Budget(self.limits.max_objects as u64);
        let entries = self.entries(root);
        budget.spend(entries.len(), self)?;
        all.push(TensorDict {
            path: String::new(),
            direct: 0,
            total: 0,
            parent: None,
        });
        let mut stack = vec![Frame {
            entries,
            next: 0,
            index: 0,
        }];
        while let Some(top) = stack.last_mut() {
            let Some((key, value)) = top.entries.get(top.next).cloned() else {
                // Done with this dict: add its total to its parent's.
                let index = top.index;
                stack.pop();
                if let Some(p) = all[index].parent {
                    all[p].total += all[index].total;
                }
                continue;
            };
            top.next += 1;
            let index = top.index;
            match &*self.pickle.get(value) {
                Object::Tensor(_) => {
                    all[index].direct += 1;
                    all[index].total += 1;
                }
                Object::Dict(_) => {
                    // Borrowed from the arena (not the match's temporary): its keys are.
                    let Some(d) = self.dict(value) else { continue };
                    if stack.len() >= self.limits.max_depth {
                        return Err(TorchError::WalkTooLarge {
                            limit: self.limits.max_depth as u64,
                        });
                    }
                    let entries = self.entries(d);
                    budget.spend(entries.len() + 1, self)?;
                    let path = join(&all[index].path, key, self);
                    all.push(TensorDict {
                        path,
                        direct: 0,
                        total: 0,
                        parent: Some(index),
                    });
                    stack.push(Frame {
                        entries,
                        next: 0,
                        index: all.len() - 1,
                    });
                }
                _ => {}
            }
        }
        // Keep the dicts that hold tensors, renumbering parents.
        let mut renumber = vec![None; all.len()];
        let mut kept = Vec::new();
        for (i, mut d) in all.into_iter().enumerate() {
            if d.total > 0 {
                d.parent = d.parent.and_then(|p| renumber[p]);
                renumber[i] = Some(kept.len());
                kept.push(d);
            }
        }
        Ok(kept)
    }

    /// Find the object a dotted key names: the exact key first, then the longest prefix
    /// (at a dot) that names a dict, and the rest within it.
    fn resolve_key(&self, key: &str) -> Option<ObjId> {
        let mut cur = self.pickle.root;
        let mut rest = key;
        for _ in 0..=key.len() {
            if rest.is_empty() {
                return Some(cur);
            }
            let entries = self.entries(self.dict(cur)?);
            let find = |k: &str| {
                entries
                    .iter()
                    .find(|(e, _)| {
                        e.name() == Some(k) || matches!(e, Key::Int(i) if i.to_string() == k)
                    })
                    .map(|&(_, v)| v)
            };
            if let Some(v) = find(rest) {
                return Some(v);
            }
            let split = rest.match_indices('.').rev().find_map(|(i, _)| {
                find(&rest[..i])
                    .filter(|&v| self.dict(v).is_some())
                    .map(|v| (i, v))
            });
            let (i, v) = split?;
            cur = v;
            rest = &rest[i + 1..];
        }
        None
    }

    /// Select the tensors of one dict and flatten them to `(name, tensor)`.
    ///
    /// `key`: the dotted path of the dict (a key containing dots is tried whole first);
    /// `Some("")` is the top level. Without a key: the top level if it holds tensors itself,
    /// else the only dict of tensors (descending through single candidates), else an error
    /// listing the candidates. Dicts below the chosen one are flattened with `.`; two
    /// tensors that end with one name are an error. (Prefixes a user drops from the names
    /// are dropped from every input's names alike: `input::strip_prefixes`.)
    pub fn select(&self, key: Option<&str>) -> Result<Selection, TorchError> {
        self.select_releasing(key, &|| {})
    }

    /// [`Self::select`], calling `read` once the names are read from the pickle (copied):
    /// the pages they were borrowed from may then be dropped.
    pub fn select_releasing(
        &self,
        key: Option<&str>,
        read: &dyn Fn(),
    ) -> Result<Selection, TorchError> {
        let (path, dict) = match key {
            Some(key) => {
                let candidates = || -> Vec<(String, usize)> {
                    self.tensor_dicts()
                        .map(|l| l.into_iter().map(|d| (d.path, d.total)).collect())
                        .unwrap_or_default()
                };
                let Some(id) = self.resolve_key(key) else {
                    return Err(TorchError::KeyNotFound {
                        key: key.to_string(),
                        candidates: candidates(),
                    });
                };
                if self.dict(id).is_none() {
                    return Err(self.not_a_dict(key, id));
                }
                (key.to_string(), id)
            }
            None => self.auto_select()?,
        };
        let (named, skipped) = self.flatten(dict, false)?;
        read();
        // Two tensors of one name (`{'a': {'b': t}}` and `{'a.b': t}`).
        let repeat = crate::naming::first_repeat(named.len(), |i| named[i].0.as_str());
        let until = repeat.map_or(named.len(), |(_, second)| second + 1);
        let mut tensors: Vec<NamedTensor> = Vec::with_capacity(until);
        for (i, (source, index)) in named.into_iter().take(until).enumerate() {
            let desc = match self.tensors.get(index) {
                Some(Ok(desc)) => desc.clone(),
                Some(Err(problem)) => {
                    return Err(TorchError::Tensor {
                        name: source,
                        problem: problem.clone(),
                    })
                }
                None => return Err(too_large(self)),
            };
            let name = source.clone();
            if name == "__metadata__" {
                return Err(TorchError::Tensor {
                    name: source,
                    problem: TensorProblem::ReservedName,
                });
            }
            if let Some((other, _)) = repeat.filter(|&(_, second)| second == i) {
                let mut first = tensors[other].source.clone();
                let mut second = source;
                if first == second {
                    // `{'a': {'b': t}}` and `{'a.b': t}`, or `'1'` and `1`: name them by
                    // their keys, as Python subscripts them.
                    let (paths, _) = self.flatten(dict, true)?;
                    first = paths[other].0.clone();
                    second = paths[i].0.clone();
                }
                return Err(TorchError::DuplicateName {
                    name,
                    first,
                    second,
                });
            }
            tensors.push(NamedTensor { name, source, desc });
        }
        Ok(Selection {
            key: path,
            tensors,
            skipped,
            placeholders: self.placeholders.clone(),
        })
    }

    fn not_a_dict(&self, key: &str, id: ObjId) -> TorchError {
        let found = match &*self.pickle.get(id) {
            Object::Placeholder(p) if p.called => {
                format!("an object of the unlisted class {}", p.global)
            }
            other => other.kind().to_string(),
        };
        TorchError::NotADict {
            key: key.to_string(),
            found,
        }
    }

    fn auto_select(&self) -> Result<(String, ObjId), TorchError> {
        if self.dict(self.pickle.root).is_none() {
            return Err(self.not_a_dict("", self.pickle.root));
        }
        let dicts = self.tensor_dicts()?;
        let Some(mut cur) = dicts.iter().position(|d| d.parent.is_none()) else {
            return Err(TorchError::NoTensors);
        };
        let mut children: Vec<Vec<usize>> = vec![Vec::new(); dicts.len()];
        for (i, d) in dicts.iter().enumerate() {
            if let Some(p) = d.parent {
                children[p].push(i);
            }
        }
        loop {
            if dicts[cur].direct > 0 {
                break;
            }
            match children[cur].as_slice() {
                [] => return Err(TorchError::NoTensors),
                [only] => cur = *only,
                many => {
                    return Err(TorchError::Ambiguous {
                        candidates: many
                            .iter()
                            .map(|&i| (dicts[i].path.clone(), dicts[i].total))
                            .collect(),
                    })
                }
            }
        }
        let path = dicts[cur].path.clone();
        // Paths built from rendered keys resolve back to the same dict.
        let id = if path.is_empty() {
            Some(self.pickle.root)
        } else {
            self.resolve_key(&path)
        };
        match id {
            Some(id) if self.dict(id).is_some() => Ok((path, id)),
            _ => Err(TorchError::KeyNotFound {
                key: path,
                candidates: Vec::new(),
            }),
        }
    }

    /// The tensors (dotted name, tensor index) and skipped entry names below `dict`.
    #[allow(clippy::type_complexity)]
    /// The tensors below `dict`, named by their dotted paths (or, with `subscripts`, by
    /// their keys as Python writes them: `['a']['b']`), and the names of what is skipped.
    fn flatten(
        &self,
        dict: ObjId,
        subscripts: bool,
    ) -> Result<(Vec<(String, usize)>, Vec<String>), TorchError> {
        let mut tensors = Vec::new();
        let mut skipped = Vec::new();
        let mut budget = Budget(self.limits.max_objects as u64);
        let Some(d) = self.dict(dict) else {
            return Ok((tensors, skipped));
        };
        let entries = self.entries(d);
        budget.spend(entries.len(), self)?;
        // Each frame: a dict's entries, the next to visit, and the dict's dotted path.
        // Each frame also carries the kind of the first key on its path that is neither a
        // str nor an int (a bytes or tuple key): a tensor below it has no name to write.
        type Frame<'p> = (Vec<(Key<'p>, ObjId)>, usize, String, Option<&'static str>);
        let mut stack: Vec<Frame<'_>> = vec![(entries, 0, String::new(), None)];
        while let Some((entries, next, path, odd)) = stack.last_mut() {
            let Some((key, value)) = entries.get(*next).cloned() else {
                stack.pop();
                continue;
            };
            *next += 1;
            let name = if subscripts {
                format!("{path}{}", key.subscript(self))
            } else {
                join(path, key, self)
            };
            let odd = odd.or(match key {
                Key::Other(id) => Some(self.pickle.get(id).kind()),
                _ => None,
            });
            match &*self.pickle.get(value) {
                Object::Tensor(i) => {
                    if let Some(kind) = odd {
                        return Err(TorchError::Tensor {
                            name,
                            problem: TensorProblem::KeyNotString { kind },
                        });
                    }
                    tensors.push((name, *i as usize))
                }
                Object::Dict(_) => {
                    // Borrowed from the arena (not the match's temporary): its keys are.
                    let Some(d) = self.dict(value) else { continue };
                    if stack.len() >= self.limits.max_depth {
                        return Err(TorchError::WalkTooLarge {
                            limit: self.limits.max_depth as u64,
                        });
                    }
                    let entries = self.entries(d);
                    budget.spend(entries.len() + 1, self)?;
                    stack.push((entries, 0, name, odd));
                }
                Object::Placeholder(p) => {
                    return Err(TorchError::PlaceholderValue {
                        name,
                        global: p.global.clone(),
                    })
                }
                _ => skipped.push(name),
            }
        }
        Ok((tensors, skipped))
    }
}
