//! The PyO3 adapter: argument conversion, GIL release in bounded steps, error mapping.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use pyo3::exceptions::{PyException, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::convert::{self, Job, Options, Report, Source};
use crate::error::Error;
use crate::header::{Action, Plan, Target};
use crate::kernels::Isa;
use crate::verify::{Verifier, VerifyOptions, VerifyReport};
use crate::VERSION;

pyo3::create_exception!(
    stcast,
    StcastError,
    PyValueError,
    "Bad input or a refused operation. `kind` and `path` say which and where."
);
pyo3::create_exception!(
    stcast,
    Cancelled,
    PyException,
    "The conversion was cancelled through its `cancel` object; nothing was left behind."
);

/// Source bytes converted between two visits to Python (signals, progress, cancel).
/// At the rates we reach, that is well under a second.
const STEP_BYTES: u64 = 64 << 20;

fn to_py(py: Python<'_>, e: Error) -> PyErr {
    // A Ctrl-C that arrived while the step failed wins: the user asked to stop.
    if let Err(interrupt) = py.check_signals() {
        return interrupt;
    }
    match e {
        Error::Io { path, what, source } => match source.raw_os_error() {
            Some(errno) => {
                let text = source.to_string();
                let text = text.split(" (os error").next().unwrap_or(&text);
                // OSError(errno, ...) instantiates the matching subclass
                // (FileNotFoundError, PermissionError, ...).
                PyOSError::new_err((errno, format!("{what}: {text}"), path.into_os_string()))
            }
            None => PyOSError::new_err(format!("{}: {what}: {source}", path.display())),
        },
        Error::Cancelled => Cancelled::new_err("conversion cancelled"),
        other => {
            let err = StcastError::new_err(other.to_string());
            let value = err.value(py);
            let _ = value.setattr("kind", other.kind());
            let _ = value.setattr("path", other.path().map(|p| p.as_os_str()));
            err
        }
    }
}

/// Run engine work without the GIL; a panic becomes a one-line Python error.
fn guarded<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(py, e)),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(PyRuntimeError::new_err(format!(
                "internal error (please report it): {msg}"
            )))
        }
    }
}

fn parse_target(to: &str) -> PyResult<Target> {
    Target::parse(to).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown target {to:?}: expected \"bf16\" or \"fp16\""
        ))
    })
}

/// A kernel family by name, for tests and benchmarks that must pin one.
fn parse_isa(name: &str) -> PyResult<Isa> {
    Isa::available()
        .into_iter()
        .find(|i| i.name() == name)
        .ok_or_else(|| {
            let names: Vec<_> = Isa::available().iter().map(|i| i.name()).collect();
            PyValueError::new_err(format!("isa {name:?} is not available here: {names:?}"))
        })
}

#[pyfunction]
#[pyo3(name = "convert", signature = (src, dst, *, to="bf16", threads=None, force=false, progress=None,
                    cancel=None, warn=None, window_mib=None, isa=None))]
#[allow(clippy::too_many_arguments)]
fn py_convert<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    to: &str,
    threads: Option<usize>,
    force: bool,
    progress: Option<Bound<'py, PyAny>>,
    cancel: Option<Bound<'py, PyAny>>,
    warn: Option<Bound<'py, PyAny>>,
    window_mib: Option<usize>,
    isa: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = Options {
        target: parse_target(to)?,
        threads: threads.unwrap_or(0),
        force,
        window: window_mib.map_or(convert::DEFAULT_WINDOW, |m| m.max(1) << 20),
        isa: isa.map(parse_isa).transpose()?,
        ..Options::default()
    };
    let mut job = guarded(py, || Job::open(&src, &dst, &opts))?;
    if let Some(w) = &warn {
        for msg in &job.plan().warnings {
            w.call1((msg,))?;
        }
    }
    if let Some(p) = &progress {
        p.call1(job.progress())?;
    }
    // Dropping `job` on any early return below removes the unpublished output.
    loop {
        let finished = guarded(py, || job.step(STEP_BYTES))?;
        py.check_signals()?;
        if let Some(c) = &cancel {
            if c.call_method0("is_set")?.is_truthy()? {
                return Err(Cancelled::new_err("conversion cancelled"));
            }
        }
        if let Some(p) = &progress {
            p.call1(job.progress())?;
        }
        if finished {
            break;
        }
    }
    let report = guarded(py, move || job.finish())?;
    report_dict(py, &report)
}

fn report_dict<'py>(py: Python<'py>, r: &Report) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("src", r.src.as_os_str())?;
    d.set_item("dst", r.dst.as_os_str())?;
    d.set_item("to", r.target.name())?;
    d.set_item("tensors_converted", r.tensors_converted)?;
    d.set_item("tensors_copied", r.tensors_copied)?;
    d.set_item("bytes_in", r.bytes_in)?;
    d.set_item("bytes_out", r.bytes_out)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("threads", r.threads)?;
    d.set_item("isa", r.isa.name())?;
    d.set_item("warnings", PyList::new(py, &r.warnings)?)?;
    Ok(d)
}

#[pyfunction]
#[pyo3(name = "inspect", signature = (path, to="bf16"))]
fn py_inspect<'py>(py: Python<'py>, path: PathBuf, to: &str) -> PyResult<Bound<'py, PyDict>> {
    let target = parse_target(to)?;
    let (src, plan) = guarded(py, || convert::inspect(&path, target))?;
    inspect_dict(py, &src, &plan)
}

fn inspect_dict<'py>(py: Python<'py>, src: &Source, plan: &Plan) -> PyResult<Bound<'py, PyDict>> {
    let h = &src.header;
    let d = PyDict::new(py);
    d.set_item("path", src.path.as_os_str())?;
    d.set_item("header_bytes", h.header_len)?;
    d.set_item("data_bytes", h.data_len())?;
    d.set_item("file_bytes", src.map.len())?;
    match &h.metadata {
        Some(meta) => {
            let m = PyDict::new(py);
            for (k, v) in meta {
                m.set_item(k, v)?;
            }
            d.set_item("metadata", m)?;
        }
        None => d.set_item("metadata", py.None())?,
    }
    // The plan is in output order; report tensors in input order with their fate.
    let mut fate = vec![None; h.tensors.len()];
    for t in &plan.tensors {
        fate[t.source] = Some(t);
    }
    let tensors = PyList::empty(py);
    for (t, planned) in h.tensors.iter().zip(fate) {
        let planned = planned.expect("every source tensor is planned");
        let e = PyDict::new(py);
        e.set_item("name", &t.name)?;
        e.set_item("dtype", t.dtype.to_string())?;
        e.set_item("shape", &t.shape)?;
        e.set_item("bytes", t.len())?;
        e.set_item("data_offsets", [t.start, t.end])?;
        e.set_item("target_dtype", planned.dtype.to_string())?;
        e.set_item("target_bytes", planned.end - planned.start)?;
        let action = match planned.action {
            Action::Copy => "copy",
            Action::Convert(_) => "convert",
        };
        e.set_item("action", action)?;
        tensors.append(e)?;
    }
    d.set_item("tensors", tensors)?;
    d.set_item("output_bytes", plan.file_len())?;
    d.set_item("to", plan.target.name())?;
    d.set_item("warnings", PyList::new(py, &plan.warnings)?)?;
    Ok(d)
}

#[pyfunction]
#[pyo3(name = "verify", signature = (src, dst, *, loose=false, threads=None, progress=None,
                    window_mib=None))]
fn py_verify<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    loose: bool,
    threads: Option<usize>,
    progress: Option<Bound<'py, PyAny>>,
    window_mib: Option<usize>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = VerifyOptions {
        loose,
        threads: threads.unwrap_or(0),
        window: window_mib.map_or(convert::DEFAULT_WINDOW, |m| m.max(1) << 20),
    };
    let mut verifier = guarded(py, || Verifier::open(&src, &dst, &opts))?;
    if let Some(p) = &progress {
        p.call1(verifier.progress())?;
    }
    loop {
        let finished = guarded(py, || verifier.step(STEP_BYTES))?;
        py.check_signals()?;
        if let Some(p) = &progress {
            p.call1(verifier.progress())?;
        }
        if finished {
            break;
        }
    }
    verify_dict(py, &verifier.finish())
}

fn verify_dict<'py>(py: Python<'py>, r: &VerifyReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("src", r.src.as_os_str())?;
    d.set_item("dst", r.dst.as_os_str())?;
    d.set_item("ok", r.is_ok())?;
    d.set_item("loose", r.loose)?;
    d.set_item("tensors_converted", r.tensors_converted)?;
    d.set_item("tensors_identical", r.tensors_identical)?;
    d.set_item("bytes_compared", r.bytes_compared)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("threads", r.threads)?;
    d.set_item("isa", r.isa.name())?;
    match &r.mismatch {
        None => d.set_item("mismatch", py.None())?,
        Some(m) => {
            let e = PyDict::new(py);
            e.set_item("message", &m.message)?;
            e.set_item("tensor", &m.tensor)?;
            e.set_item("index", m.index)?;
            e.set_item("source_bits", &m.source_bits)?;
            e.set_item("source_value", m.source_value)?;
            e.set_item("expected_bits", &m.expected_bits)?;
            e.set_item("found_bits", &m.found_bits)?;
            d.set_item("mismatch", e)?;
        }
    }
    Ok(d)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", VERSION)?;
    m.add("StcastError", py.get_type::<StcastError>())?;
    m.add("Cancelled", py.get_type::<Cancelled>())?;
    m.add_function(wrap_pyfunction!(py_convert, m)?)?;
    m.add_function(wrap_pyfunction!(py_inspect, m)?)?;
    m.add_function(wrap_pyfunction!(py_verify, m)?)?;
    Ok(())
}
