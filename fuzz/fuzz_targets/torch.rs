//! Arbitrary bytes as a PyTorch checkpoint: sniff, read, select and gather every tensor
//! (`torch_check.rs`), then the engine's view of the same bytes (`input::checkpoint_header`):
//! every tensor it would read lies in the file, gathers, and plans.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stcast::input::{checkpoint_header, InputOptions};
use stcast::plan::{plan, PlanOptions};
use stcast::torch;
use stcast::Target;

#[path = "../torch_check.rs"]
mod check;

fuzz_target!(|data: &[u8]| {
    check::check(data);
    let choices = [
        InputOptions::default(),
        InputOptions {
            key: Some(String::new()),
            strip_prefix: vec!["module.".into(), "_orig_mod.".into()],
            ..InputOptions::default()
        },
    ];
    for opts in &choices {
        let Ok((header, origin)) = checkpoint_header(data, opts) else {
            continue;
        };
        let len = data.len() as u64;
        for t in &header.tensors {
            assert!(t.start <= t.end, "`{}`", t.name);
            match &t.gather {
                None => assert!(t.end <= len, "`{}` past the file", t.name),
                Some(g) => {
                    let d = g.view().expect("a checkpoint's gathered tensors are views");
                    d.validate().expect("a gathered view is valid");
                    assert!(d.span().end <= len, "`{}` past the file", t.name);
                    assert_eq!(t.len(), d.nbytes(), "`{}`", t.name);
                    let es = d.elem_size();
                    let n = (t.len() / es.max(1)).min(256) * es;
                    let mut out = vec![0u8; n as usize];
                    torch::gather(data, d, 0, &mut out).expect("a gathered view gathers");
                }
            }
        }
        let _ = origin.warnings();
        for target in [Target::Bf16, Target::Keep] {
            let _ = plan(std::path::Path::new("x.pt"), &header, &PlanOptions::new(target));
        }
    }
});
