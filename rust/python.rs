//! The PyO3 adapter: argument conversion, GIL release in bounded steps, error mapping.
//!
//! It holds no logic of its own: it converts arguments into engine options, steps an engine
//! task with the GIL released (checking signals, the cancel flag and progress between
//! steps), and converts what the engine returns into plain Python data. Exceptions are the
//! classes `stcast.errors` hands over at import, one per `vocab::ErrorKind` (`to_py`).

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use pyo3::exceptions::{PyIndexError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{IntoPyDict, PyDict};

use crate::convert::{Knobs, Tuning};
use crate::error::Error;
use crate::given::{Exports, Given, Settings};
use crate::input::InputOptions;
use crate::numerics::Numerics;
use crate::output::{self, Replace};
use crate::report::NumericsRow;
use crate::shard::{self, Group};
use crate::task::{ConvertTask, InspectTask, Task};
use crate::text;
use crate::verify::{Verifier, VerifyOptions};
use crate::vocab::{ErrorKind, OptionName, Side, Taken, Target, Unmatched};
use crate::VERSION;

/// What `stcast.errors` hands over at import (`_set_exceptions`), in `ErrorKind::ALL`
/// order: for each error kind, the class (or, for `io` and `cancelled`, the factory) of its
/// exception, called as `f(template, *, message, path, tensor, option, errno)`.
static EXCEPTIONS: PyOnceLock<Vec<Py<PyAny>>> = PyOnceLock::new();

/// Called once, by `stcast.errors` with each kind by name (a second call keeps the first).
#[pyfunction]
fn _set_exceptions(py: Python<'_>, classes: &Bound<'_, PyAny>) -> PyResult<()> {
    let class = |k: &ErrorKind| Ok(classes.get_item(k.name())?.unbind());
    let _ = EXCEPTIONS.set(
        py,
        ErrorKind::ALL.iter().map(class).collect::<PyResult<_>>()?,
    );
    Ok(())
}

/// The Python exception for an engine error (a Ctrl-C that arrived meanwhile wins, unless
/// the error came after the commit point).
fn to_py(py: Python<'_>, e: Error) -> PyErr {
    if !matches!(e, Error::AfterCommit { .. }) {
        if let Err(interrupt) = py.check_signals() {
            return interrupt;
        }
    }
    let build = || -> PyResult<PyErr> {
        let Some(x) = EXCEPTIONS.get(py) else {
            return Ok(PyRuntimeError::new_err(e.message()));
        };
        let class = &x[e.kind() as usize];
        let option = e.option().map(OptionName::name);
        let kwargs = [
            ("message", e.message().into_pyobject(py)?.into_any()),
            ("path", e.path().map(|p| p.as_os_str()).into_pyobject(py)?),
            ("tensor", e.tensor().into_pyobject(py)?),
            ("option", option.into_pyobject(py)?),
            ("errno", e.errno().into_pyobject(py)?),
        ]
        .into_py_dict(py)?;
        let exc = class.bind(py).call((e.template(),), Some(&kwargs))?;
        Ok(PyErr::from_value(exc))
    };
    build().unwrap_or_else(|failed| failed)
}

/// Run engine work without the GIL; a panic becomes a one-line Python error.
fn guarded<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(py, e)),
        Err(panic) => Err(PyRuntimeError::new_err(crate::error::panic_message(
            &*panic,
        ))),
    }
}

/// A callback the caller may give (`progress`, `cancel`, `warn`).
type Hook<'py> = Option<Bound<'py, PyAny>>;

/// The callbacks a task reports to between steps.
struct Hooks<'py> {
    /// Source bytes per step (`Tuning::step`).
    step: u64,
    progress: Hook<'py>,
    cancel: Hook<'py>,
    warn: Hook<'py>,
    /// `progress` was told `(total, total)`: the visits after the last step (sealing,
    /// publishing) do not tell it again, so that a caller hears of the end once.
    ended: Cell<bool>,
}

impl<'py> Hooks<'py> {
    /// Ctrl-C, the cancel flag, warnings, then progress (any of which may raise).
    fn visit(&self, py: Python<'py>, task: &mut impl Task) -> PyResult<()> {
        py.check_signals()?;
        if self.cancelled()? {
            return Err(to_py(py, Error::Cancelled));
        }
        for w in task.take_warnings() {
            if let Some(f) = &self.warn {
                f.call1((w.kind.name(), &w.text))?;
            }
        }
        if let Some(p) = &self.progress {
            let (done, total) = task.progress();
            if !self.ended.get() {
                self.ended.set(done >= total);
                p.call1((done, total))?;
            }
        }
        Ok(())
    }

    /// Step `task` to its end, visiting Python between steps.
    fn drive(&self, py: Python<'py>, task: &mut (impl Task + Send)) -> PyResult<()> {
        self.visit(py, task)?;
        loop {
            let step = self.step;
            let finished = self.run(py, || task.step(step))?;
            self.visit(py, task)?;
            if finished {
                return Ok(());
            }
        }
    }

    /// `guarded`, where a stop request that arrived meanwhile (a signal the caller's
    /// handler recorded, the cancel flag) wins over the error it caused (EINTR, say); not
    /// over a failure after the commit point, which must be told as such.
    fn run<T: Send>(
        &self,
        py: Python<'py>,
        f: impl FnOnce() -> crate::Result<T> + Send,
    ) -> PyResult<T> {
        let mut after_commit = false;
        let f = || {
            let r = f();
            after_commit = matches!(r, Err(Error::AfterCommit { .. }));
            r
        };
        let result = guarded(py, f);
        if after_commit {
            return result;
        }
        result.map_err(|e| {
            if let Err(stop) = py.check_signals() {
                return stop;
            }
            match self.cancelled() {
                Ok(true) => to_py(py, Error::Cancelled),
                _ => e,
            }
        })
    }

    /// Whether the caller's cancel flag is set.
    fn cancelled(&self) -> PyResult<bool> {
        self.cancel
            .as_ref()
            .map_or(Ok(false), |c| c.call_method0("is_set")?.is_truthy())
    }
}

/// A Python value as the engine checks an option's value (`given::Given`).
fn given(v: &Bound<'_, PyAny>) -> Given {
    let repr = v.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
    let is_bool = v.is_instance_of::<pyo3::types::PyBool>();
    Given {
        text: v.extract().ok(),
        whole: if is_bool { None } else { v.extract().ok() },
        repr,
    }
}

impl FromPyObject<'_, '_> for Given {
    type Error = PyErr;
    fn extract(v: Borrowed<'_, '_, PyAny>) -> PyResult<Given> {
        Ok(given(&v))
    }
}

impl FromPyObject<'_, '_> for Unmatched {
    type Error = PyErr;
    fn extract(v: Borrowed<'_, '_, PyAny>) -> PyResult<Unmatched> {
        let msg = || format!("keep_unmatched must be one of {:?}", Unmatched::NAMES);
        let name = v.extract::<String>()?;
        Unmatched::from_name(&name).ok_or_else(|| PyValueError::new_err(msg()))
    }
}

/// The knobs of `tuning=` (`convert::Knobs`, `Tuning::new`): speed and memory, never the bytes.
fn tuning(v: Option<&Bound<'_, PyDict>>) -> PyResult<Tuning> {
    let knobs: Knobs = match v {
        None => Knobs::default(),
        Some(d) => pythonize::depythonize(d).map_err(|e| match PyErr::from(e) {
            e if e.is_instance_of::<PyTypeError>(d.py()) => e,
            e => PyValueError::new_err(format!("tuning: {}", e.value(d.py()))),
        })?,
    };
    Tuning::new(&knobs).map_err(PyValueError::new_err)
}

/// The keywords of an engine call (`**options`, as `stcast._engine` and the folder code
/// pass them) read into the engine's `given::Settings`, and `tuning=`, made into the
/// engine's options by `make` (a `Settings` method): an absent or None keyword is the
/// default, an unknown one a TypeError.
macro_rules! options {
    ($($name:ident),* $(,)?) => {
        fn read_options<T>(
            py: Python<'_>,
            kwargs: Option<&Bound<'_, PyDict>>,
            make: impl FnOnce(&Settings, Tuning) -> crate::Result<T>,
        ) -> PyResult<T> {
            let (mut s, mut knobs) = (Settings::default(), None);
            for (k, v) in kwargs.into_iter().flat_map(|d| d.iter()) {
                let given = !v.is_none();
                match k.extract::<String>()?.as_str() {
                    $(stringify!($name) if given => s.$name = v.extract()?,)*
                    "tuning" if given => knobs = Some(v.cast_into::<PyDict>()?),
                    $(stringify!($name))|* | "tuning" => {}
                    k => {
                        let msg = format!("unexpected keyword argument {k:?}");
                        return Err(PyTypeError::new_err(msg));
                    }
                }
            }
            make(&s, tuning(knobs.as_ref())?).map_err(|e| to_py(py, e))
        }
    };
}

options! {
    to, threads, force, keep, keep_min_size, keep_unmatched, from_bf16, keep_names, on_overflow,
    numerics, report, replaces, allow_copy, key, strip_prefix, loose, allow_quantized,
    quantization_config,
}

/// The callbacks of a call, stepping by the tuning's step.
fn hooks<'py>(step: u64, progress: Hook<'py>, cancel: Hook<'py>, warn: Hook<'py>) -> Hooks<'py> {
    Hooks {
        step,
        progress,
        cancel,
        warn,
        ended: Cell::new(false),
    }
}

#[pyfunction]
#[pyo3(name = "convert", signature = (src, dst, *, progress=None, cancel=None, warn=None,
                                      sealed=None, **options))]
#[allow(clippy::too_many_arguments)]
fn py_convert<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    progress: Hook<'py>,
    cancel: Hook<'py>,
    warn: Hook<'py>,
    sealed: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = read_options(py, options, Settings::convert)?;
    let hooks = hooks(opts.tuning.step, progress, cancel, warn);
    let task = hooks.run(py, || ConvertTask::new(&src, &dst, &opts))?;
    finish_convert(py, &hooks, task, opts.numerics, sealed)
}

/// Step a conversion to its end, seal and publish it; its report as a dict. `sealed`, if
/// given, is called with the hidden output's (dev, ino, size) between sealing and
/// publishing (a folder run records them in its manifest before the file has a name);
/// if it raises, nothing is published.
fn finish_convert<'py>(
    py: Python<'py>,
    hooks: &Hooks<'py>,
    mut task: ConvertTask,
    numerics: bool,
    sealed: Hook<'py>,
) -> PyResult<Bound<'py, PyDict>> {
    // Dropping `task` on any early return removes the unpublished output.
    hooks.drive(py, &mut task)?;
    hooks.run(py, || task.seal())?;
    // The last chance to stop: a signal or cancel until here leaves nothing behind.
    hooks.visit(py, &mut task)?;
    if let Some(f) = &sealed {
        let id = task.sealed().map_err(|e| to_py(py, e))?;
        f.call1((id.dev, id.ino, id.size))?;
        hooks.visit(py, &mut task)?;
    }
    let r = hooks.run(py, move || task.publish())?;
    let d = crossed(py, &r, &[("src", &r.src), ("dst", &r.dst)])?;
    let measured = numerics.then(|| numerics_dict(py, &r.numerics, &r.numerics_total));
    d.set_item("numerics", measured.transpose()?)?;
    Ok(d)
}

/// The input files of one re-sharded group, opened and validated (`shard::Group`).
#[pyclass(frozen, module = "stcast._core")]
struct ShardGroup {
    group: Group,
}

#[pymethods]
impl ShardGroup {
    #[new]
    #[pyo3(signature = (paths, *, key=None, strip_prefix=Vec::new()))]
    fn new(
        py: Python<'_>,
        paths: Vec<PathBuf>,
        key: Option<String>,
        strip_prefix: Vec<String>,
    ) -> PyResult<ShardGroup> {
        let input = InputOptions { key, strip_prefix };
        let group = guarded(py, || Group::open(&paths, &input))?;
        Ok(ShardGroup { group })
    }

    /// Its files, in input order.
    fn paths(&self) -> Vec<PathBuf> {
        self.group.paths().map(|p| p.to_path_buf()).collect()
    }

    /// Its tensors' names, in input order.
    fn names(&self) -> Vec<&str> {
        self.group.names().collect()
    }

    /// Its tensors' bytes, in input order.
    fn sizes(&self) -> Vec<u64> {
        self.group.sizes().collect()
    }

    /// Its output shards of at most `max_size` bytes (`shard::Group::plan`).
    #[pyo3(signature = (max_size, **options))]
    fn plan<'py>(
        &self,
        py: Python<'py>,
        max_size: u64,
        options: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let opts = read_options(py, options, |s, _| s.shard_plan())?;
        let plan = guarded(py, || self.group.plan(max_size, &opts))?;
        crossed(py, &self.group.rows(&plan), &[])
    }
}

/// Convert the output shard of `group` holding `names` into `dst` (`shard::Group::task`).
#[pyfunction]
#[pyo3(signature = (group, names, indexed, dst, *, progress=None, cancel=None, warn=None,
                    sealed=None, **options))]
#[allow(clippy::too_many_arguments)]
fn convert_shard<'py>(
    py: Python<'py>,
    group: &Bound<'py, ShardGroup>,
    names: Vec<String>,
    indexed: bool,
    dst: PathBuf,
    progress: Hook<'py>,
    cancel: Hook<'py>,
    warn: Hook<'py>,
    sealed: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = read_options(py, options, Settings::shard_convert)?;
    let hooks = hooks(opts.tuning.step, progress, cancel, warn);
    let group = &group.get().group;
    let task = hooks.run(py, || group.task(&names, indexed, &dst, &opts))?;
    finish_convert(py, &hooks, task, opts.numerics, sealed)
}

/// Verify the file `dst` as an output shard of `group` (see `shard::Group::verifier`).
#[pyfunction]
#[pyo3(signature = (group, dst, indexed, *, progress=None, **options))]
fn verify_shard<'py>(
    py: Python<'py>,
    group: &Bound<'py, ShardGroup>,
    dst: PathBuf,
    indexed: bool,
    progress: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = read_options(py, options, Settings::shard_verify)?;
    let group = &group.get().group;
    let verifier = guarded(py, || group.verifier(&dst, indexed, &opts))?;
    finish_verify(py, progress, verifier, &opts)
}

/// A size option (`max_shard_size`), as `Given::size` reads it.
#[pyfunction]
fn parse_size(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    given(value).size().map_err(|e| to_py(py, e))
}

/// The `name` option: the stem of a re-sharded group's outputs (`Given::stem`).
#[pyfunction]
fn check_name(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<String> {
    given(value).stem().map_err(|e| to_py(py, e))
}

/// The file name of output shard `i` of `n` of the group `stem` (`shard::shard_file_name`).
#[pyfunction]
fn shard_file_name(stem: &str, i: usize, n: usize) -> String {
    shard::shard_file_name(stem, i, n)
}

/// The index file of the group `stem`.
#[pyfunction]
fn index_file_name(stem: &str) -> String {
    shard::index_file_name(stem)
}

/// Is the folder one checkpoint (DCP)? One stcast cannot read is refused, naming it.
#[pyfunction]
fn check_folder(py: Python<'_>, path: PathBuf) -> PyResult<bool> {
    guarded(py, || crate::input::folder::check_folder(&path))
}

/// The header of a safetensors file (`source::read_header`).
#[pyfunction]
fn read_header(py: Python<'_>, path: PathBuf) -> PyResult<crate::source::HeaderSummary> {
    guarded(py, || crate::source::read_header(&path))
}

/// An engine report as a dict (its serde form, once), with its paths as Python holds them
/// (any bytes: serde would refuse a path that is not UTF-8).
fn crossed<'py>(
    py: Python<'py>,
    value: &impl serde::Serialize,
    paths: &[(&str, &Path)],
) -> PyResult<Bound<'py, PyDict>> {
    let d = pythonize::pythonize(py, value)?.cast_into::<PyDict>()?;
    for (k, p) in paths {
        d.set_item(*k, p.as_os_str())?;
    }
    Ok(d)
}

/// `{"tensors": TensorNumerics, "total": {counts and errors}}`.
fn numerics_dict<'py>(
    py: Python<'py>,
    tensors: &[(String, Numerics)],
    total: &Numerics,
) -> PyResult<Bound<'py, PyDict>> {
    let rows = TensorNumerics {
        rows: tensors.to_vec(),
        total: total.clone(),
    };
    let d = PyDict::new(py);
    d.set_item("tensors", Bound::new(py, rows)?)?;
    d.set_item("total", pythonize::pythonize(py, total)?)?;
    Ok(d)
}

/// The per-tensor numeric reports of a run, each row a dict built when read (300,000 tensors
/// cost no 300,000 dicts unless used): `stcast.reports` makes the sequence of them.
#[pyclass(frozen, module = "stcast._core")]
struct TensorNumerics {
    rows: Vec<(String, Numerics)>,
    /// Their total (what a folder's numeric report adds up, `write_numeric_report`).
    total: Numerics,
}

#[pymethods]
impl TensorNumerics {
    fn __len__(&self) -> usize {
        self.rows.len()
    }

    /// Row `i` (`0 <= i < len`) as a dict: its name, then its counts and errors.
    fn row<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        let (name, numerics) = self
            .rows
            .get(i)
            .ok_or_else(|| PyIndexError::new_err("index out of range"))?;
        Ok(pythonize::pythonize(py, &NumericsRow { name, numerics })?)
    }
}

#[pyfunction]
#[pyo3(name = "inspect", signature = (path, *, scan=false, dst=None, progress=None,
                                      **options))]
fn py_inspect<'py>(
    py: Python<'py>,
    path: PathBuf,
    scan: bool,
    dst: Option<PathBuf>,
    progress: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = read_options(py, options, |s, t| s.inspect(t, dst.is_some()))?;
    let mut task = guarded(py, || InspectTask::new(&path, scan, &opts, dst.as_deref()))?;
    let hooks = hooks(opts.tuning.step, progress, None, None);
    hooks.drive(py, &mut task)?;
    let found = guarded(py, move || task.finish())?;
    crossed(py, &found.rows(), &[("path", &found.source.path)])
}

#[pyfunction]
#[pyo3(name = "verify", signature = (src, dst, *, progress=None, **options))]
fn py_verify<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    progress: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = read_options(py, options, Settings::verify)?;
    let verifier = guarded(py, || Verifier::open(&src, &dst, &opts))?;
    finish_verify(py, progress, verifier, &opts)
}

/// Step a verification to its end; its report as a dict.
fn finish_verify<'py>(
    py: Python<'py>,
    progress: Hook<'py>,
    mut verifier: Verifier,
    opts: &VerifyOptions,
) -> PyResult<Bound<'py, PyDict>> {
    hooks(opts.tuning.step, progress, None, None).drive(py, &mut verifier)?;
    let r = guarded(py, move || verifier.finish())?;
    let d = crossed(py, &r, &[("src", &r.src), ("dst", &r.dst)])?;
    d.set_item("ok", r.is_ok())?;
    // Only a verified pair has the numbers of a conversion.
    let measured =
        (opts.numerics && r.is_ok()).then(|| numerics_dict(py, &r.numerics, &r.numerics_total));
    d.set_item("numerics", measured.transpose()?)?;
    Ok(d)
}

/// How to publish over an existing name (`output::Replace`): None, "any", or (dev, ino).
fn replace_policy(v: Option<&Bound<'_, PyAny>>) -> PyResult<Replace> {
    match v.filter(|v| !v.is_none()) {
        None => Ok(Replace::No),
        Some(v) if v.extract::<String>().is_ok_and(|s| s == "any") => Ok(Replace::Any),
        Some(v) => {
            let msg = "replace must be None, \"any\" or (dev, ino)";
            let (dev, ino) = v.extract().map_err(|_| PyValueError::new_err(msg))?;
            Ok(Replace::Same { dev, ino })
        }
    }
}

/// Write `data` as the file `path`, atomically (`output::write_file`).
#[pyfunction]
#[pyo3(signature = (path, data, *, replace=None, tag="", cancel=None, sealed=None))]
fn write_file<'py>(
    py: Python<'py>,
    path: PathBuf,
    data: Vec<u8>,
    replace: Option<&Bound<'py, PyAny>>,
    tag: &str,
    cancel: Hook<'py>,
    sealed: Hook<'py>,
) -> PyResult<(u64, u64, u64)> {
    let replace = replace_policy(replace)?;
    let hooks = hooks(Tuning::default().step, None, cancel, None);
    // A stop request that interrupted the write (EINTR) wins over the error it caused.
    let out = hooks.run(py, || output::sealed_file(&path, &data, replace, tag))?;
    publish_sealed(py, &hooks, out, sealed)
}

/// Publish a sealed output, telling `sealed` (if given) its (dev, ino, size) first; if
/// that raises, or a stop request comes meanwhile, nothing is published.
fn publish_sealed<'py>(
    py: Python<'py>,
    hooks: &Hooks<'py>,
    out: output::TempOutput,
    sealed: Hook<'py>,
) -> PyResult<(u64, u64, u64)> {
    if let Some(f) = &sealed {
        let id = out.identity().map_err(|e| to_py(py, e))?;
        f.call1((id.dev, id.ino, id.size))?;
        py.check_signals()?;
        if hooks.cancelled()? {
            return Err(to_py(py, Error::Cancelled));
        }
    }
    let p = hooks.run(py, move || out.publish())?;
    Ok(p.into())
}

/// Copy the regular file `src` to `dst` atomically, in bounded steps (`output::Copy`).
#[pyfunction]
#[pyo3(signature = (src, dst, *, replace=None, tag="", progress=None, cancel=None,
                    sealed=None))]
#[allow(clippy::too_many_arguments)]
fn copy_file<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    replace: Option<&Bound<'py, PyAny>>,
    tag: &str,
    progress: Hook<'py>,
    cancel: Hook<'py>,
    sealed: Hook<'py>,
) -> PyResult<(u64, u64, u64)> {
    let replace = replace_policy(replace)?;
    let hooks = hooks(Tuning::default().step, progress, cancel, None);
    let mut copy = hooks.run(py, || output::Copy::new(&src, &dst, replace, tag))?;
    hooks.drive(py, &mut copy)?;
    let out = hooks.run(py, move || copy.seal())?;
    publish_sealed(py, &hooks, out, sealed)
}

/// Write a folder's numeric report to `path` from each file's rows (`report::files_report`).
#[pyfunction]
#[pyo3(signature = (path, src, dst, to, parts, *, replace=None))]
fn write_numeric_report<'py>(
    py: Python<'py>,
    path: PathBuf,
    src: PathBuf,
    dst: PathBuf,
    to: Option<&str>,
    parts: Vec<(Option<String>, Bound<'py, TensorNumerics>)>,
    replace: Option<&Bound<'py, PyAny>>,
) -> PyResult<(u64, u64, u64)> {
    let parts: Vec<_> = parts.iter().map(|(f, r)| (f.as_deref(), r.get())).collect();
    let parts: Vec<_> = parts
        .iter()
        .map(|(f, r)| (*f, &r.rows[..], &r.total))
        .collect();
    let target = to.and_then(Target::from_name);
    let bytes = crate::report::files_report(&src, &dst, target, &parts);
    let replace = replace_policy(replace)?;
    let p = guarded(py, || output::write_file(&path, &bytes, replace, ""))?;
    Ok(p.into())
}

/// Check a side output's path before any work (`output::check_side_path`); its replace policy.
#[pyfunction]
#[pyo3(signature = (path, role, force, taken))]
fn check_side_output(
    py: Python<'_>,
    path: PathBuf,
    role: &str,
    force: bool,
    taken: Vec<(PathBuf, String)>,
) -> PyResult<Option<&'static str>> {
    let role = named("role", role, Side::from_name, Side::NAMES)?;
    let taken = taken
        .into_iter()
        .map(|(p, w)| Ok((p, named("taken", &w, Taken::from_name, Taken::NAMES)?)));
    let taken = taken.collect::<PyResult<Vec<_>>>()?;
    let replace = guarded(py, || output::check_side_path(&path, role, force, &taken))?;
    Ok((!matches!(replace, Replace::No)).then_some("any"))
}

/// A name of the engine's vocabulary (`from_name`), or a ValueError naming `what`.
fn named<T>(what: &str, name: &str, from: fn(&str) -> Option<T>, names: &[&str]) -> PyResult<T> {
    from(name).ok_or_else(|| PyValueError::new_err(format!("{what}: one of {names:?}")))
}

/// Render a message template, calling `option(name, value)` for each placeholder.
#[pyfunction]
fn render(template: &str, option: &Bound<'_, PyAny>) -> PyResult<String> {
    let mut failed = None;
    let out = text::render(template, |p| {
        let r = option.call1((p.option.name(), p.value));
        r.and_then(|r| r.extract()).unwrap_or_else(|e| {
            failed.get_or_insert(e);
            String::new()
        })
    });
    failed.map_or(Ok(out), Err)
}

/// Bytes in the one unit system of every message: decimal, three significant digits.
#[pyfunction]
fn format_bytes(n: u64) -> String {
    text::format_bytes(n)
}

/// Escape braces in data put into a template.
#[pyfunction]
fn escape(s: &str) -> String {
    text::esc(s).into_owned()
}

/// The usage error for an option's value, as the engine words it (for checks made in Python).
#[pyfunction]
fn option_error<'py>(
    py: Python<'py>,
    option: &str,
    value: &Bound<'py, PyAny>,
    expected: &str,
) -> PyResult<Py<pyo3::exceptions::PyBaseException>> {
    let option = OptionName::from_name(option)
        .ok_or_else(|| PyValueError::new_err(format!("unknown option {option:?}")))?;
    Ok(to_py(py, given(value).bad(option, expected)).into_value(py))
}

/// The canonical name of a target or one of its aliases, as `Given::target` reads it.
#[pyfunction]
fn target_name(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<&'static str> {
    Ok(given(value).target().map_err(|e| to_py(py, e))?.name())
}

/// Hit a failpoint of the Python side (`failpoint` module): raises the injected error.
#[pyfunction]
fn failpoint(py: Python<'_>, name: &str) -> PyResult<()> {
    crate::failpoint::hit(name).map_err(|e| to_py(py, Error::io(Path::new(name), "failpoint", e)))
}

/// Add each `#[pyfunction]` to the module.
macro_rules! add_functions {
    ($m:ident: $($f:ident),* $(,)?) => {
        $($m.add_function(wrap_pyfunction!($f, $m)?)?;)*
    };
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", VERSION)?;
    m.add_class::<TensorNumerics>()?;
    let exports = pythonize::pythonize(m.py(), &Exports::default())?;
    for (name, value) in exports.cast_into::<PyDict>()?.iter() {
        m.add(name.cast_into::<pyo3::types::PyString>()?, value)?;
    }
    m.add_class::<ShardGroup>()?;
    add_functions! {
        m: _set_exceptions, py_convert, py_inspect, py_verify, render, format_bytes, escape,
        option_error, target_name, failpoint, write_file, copy_file, write_numeric_report,
        check_side_output, convert_shard, verify_shard, parse_size, check_name,
        shard_file_name, index_file_name, check_folder, read_header,
    }
    Ok(())
}
