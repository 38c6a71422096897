//! The levels of `src/`, checked: dependencies point one way, down.
//!
//! `src/` is laid out in levels, one folder each, lowest first:
//!
//! | rank | level | folder |
//! | --- | --- | --- |
//! | 1 | seam | `driver/` |
//! | 2 | core | `core/` |
//! | 3 | memory | `memory/` |
//! | 4 | lifecycle | `lifecycle/` |
//! | 5 | work | `work/` |
//! | 6 | routes | `routes/` |
//!
//! The lifecycle holds the proofs and the one typestate over them, `Pending` (in
//! `lifecycle/pending/`); work is compute on one engine (kernels, libraries, graphs, raw and
//! CubeCL scopes); everything that crosses an engine's edge is a route, at the top: to the host,
//! a peer, other ranks (collectives), other processes (sharing) and files (checkpoints). So a
//! library's verdict read back in `work/` goes through the lifecycle's scalar band, never a route.
//!
//! Below them all sit `error.rs`, `dtype.rs`, `ledger.rs` and `sync/` (the errors, the element tag
//! they name, the engine's count of the memory it holds, which the errors carry,
//! and the host concurrency: the synchronization primitives that a loom build swaps for loom's,
//! in `sync/mod.rs`, the process's host-copy threads built on them, in `sync/copy_pool.rs`, and
//! the one deadline of a whole exchange with a peer, in `sync/deadline.rs`, and the lock guard
//! that releases its lock before its holder's leftovers run, in `sync/unlock_first.rs`),
//! which every level may use and which use nothing else. `lib.rs` (the root, which declares and
//! re-exports everything) and `guide.rs` (documentation) are not levels.
//!
//! This test reads every source file, finds every path it names into the crate (`use`
//! declarations and paths in code alike: `crate::…`, `super::…`, `self::…` and paths through
//! the file's own child modules, with `{…}` groups expanded, and the crate root's re-exports
//! followed to what they re-export) and resolves each to the file that defines it. Comments and
//! string literals are not code and are skipped for that. It then checks:
//!
//! 1. Nothing under `driver/` mentions the levels above it or the engine: no file there contains
//!    `crate::core`, `crate::memory`, `crate::lifecycle`, `crate::routes`, `crate::work` or
//!    `CudaEngine`, not even in a comment, and every path it names resolves to the seam or the
//!    base.
//! 2. No file names a path into a level above its own, and the base names nothing but the base.
//!    There is no exception, the core's included: the engine holds the state that the levels
//!    above keep per engine (the pinned pool, the staging ring, the kernel cache, ...) as parts,
//!    by type, through a trait the core defines and those levels implement (`core::parts`), so
//!    no file of the core names their types. With every edge pointing down or within a level, a
//!    cycle through two levels has an edge that points up, and is caught as one.
//!
//! A path that resolves to no file the checker knows is refused too, since it could hide
//! anything. The checker itself is tested on small made-up trees below, one per kind of
//! violation, so a change that blinds it fails here too.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The levels, lowest first. A level's rank is its index plus one; the base is rank 0.
const LEVELS: [&str; 6] = ["driver", "core", "memory", "lifecycle", "work", "routes"];

/// The files below every level.
const BASE: [&str; 9] = [
    "device.rs",
    "error.rs",
    "dtype.rs",
    "fd_passing.rs",
    "ledger.rs",
    "sync/mod.rs",
    "sync/copy_pool.rs",
    "sync/deadline.rs",
    "sync/unlock_first.rs",
];

/// The files at the top that are not levels.
const NOT_LEVELS: [&str; 2] = ["lib.rs", "guide.rs"];

/// What no file under `driver/` may mention.
const NOT_IN_THE_SEAM: [&str; 6] = [
    "crate::core",
    "crate::memory",
    "crate::lifecycle",
    "crate::routes",
    "crate::work",
    "CudaEngine",
];

#[test]
fn dependencies_point_down() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let tree = Tree::read(&root);
    let violations = tree.violations();
    assert!(
        violations.is_empty(),
        "{} violation(s) of the levels (see tests/levels.rs):\n{}",
        violations.len(),
        violations.join("\n")
    );
}

#[test]
fn the_checker_sees_the_real_edges() {
    // A blind checker passes everything: make sure it sees what is there.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let tree = Tree::read(&root);
    for (from, to) in [
        ("core/engine.rs", "core/parts.rs"),
        ("core/engine.rs", "core/retire.rs"),
        ("core/engine.rs", "driver/mod.rs"),
        ("memory/pool.rs", "core/parts.rs"),
        ("memory/ring.rs", "core/parts.rs"),
        ("work/kernels/cache.rs", "core/parts.rs"),
        ("memory/pinned.rs", "memory/pool.rs"),
        ("memory/pressure.rs", "memory/ring.rs"),
        ("lifecycle/fence.rs", "core/retire.rs"),
        ("lifecycle/lease.rs", "memory/ring.rs"),
        ("routes/host/blocking.rs", "lifecycle/lease.rs"),
        ("routes/host/blocking.rs", "lifecycle/scalar.rs"),
        ("routes/host/blocking.rs", "sync/copy_pool.rs"),
        ("memory/ring.rs", "sync/copy_pool.rs"),
        ("sync/copy_pool.rs", "sync/mod.rs"),
        ("sync/copy_pool.rs", "error.rs"),
        ("routes/collective/bootstrap.rs", "sync/deadline.rs"),
        ("routes/share/wire.rs", "sync/deadline.rs"),
        ("lifecycle/scalar.rs", "lifecycle/lease.rs"),
        ("lifecycle/scalar.rs", "lifecycle/fence.rs"),
        ("routes/host/blocking.rs", "memory/ring.rs"),
        ("lifecycle/pending/mod.rs", "lifecycle/fence.rs"),
        ("lifecycle/pending/mod.rs", "lifecycle/fence_future.rs"),
        ("routes/host/pending.rs", "lifecycle/pending/mod.rs"),
        ("routes/collective/mod.rs", "lifecycle/pending/mod.rs"),
        ("routes/collective/ranks.rs", "lifecycle/pending/mod.rs"),
        ("routes/peer/pending.rs", "lifecycle/pending/mod.rs"),
        ("work/kernels/mod.rs", "work/kernels/cache.rs"),
        ("work/kernels/cache.rs", "work/kernels/emulate.rs"),
        ("work/kernels/emulate.rs", "driver/launch.rs"),
        ("work/libs/blas.rs", "driver/libs.rs"),
        ("work/libs/solver.rs", "lifecycle/scalar.rs"),
        ("driver/sim/launch.rs", "driver/sim/mod.rs"),
        ("lib.rs", "core/retire.rs"),
        ("lib.rs", "lifecycle/pending/mod.rs"),
        ("lib.rs", "routes/collective/mod.rs"),
        ("lib.rs", "routes/share/mod.rs"),
        ("driver/sim/state.rs", "driver/callbacks.rs"),
    ] {
        assert!(
            tree.targets(from).contains(to),
            "{from} should name {to}; it names {:?}",
            tree.targets(from)
        );
    }
}

/// One module style: a module with children is `foo/mod.rs`, never `foo.rs` beside a `foo/`.
#[test]
fn a_module_with_children_is_a_folder_with_mod_rs() {
    fn walk(dir: &Path, found: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if path.with_extension("rs").exists() {
                    found.push(path.display().to_string());
                }
                if !path.join("mod.rs").exists() {
                    found.push(format!("{} (no mod.rs)", path.display()));
                }
                walk(&path, found);
            }
        }
    }
    let mut found = Vec::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut found,
    );
    assert!(found.is_empty(), "modules of the other style: {found:?}");
}

// ---------------------------------------------------------------------------------------------
// The checker, tested on made-up trees.

/// A small tree that keeps the rules, to which each test adds one violation. Its engine holds
/// the pool and the cache as parts, which name the core's part trait.
fn good_tree() -> Vec<(&'static str, &'static str)> {
    vec![
        (
            "lib.rs",
            "mod driver; mod core; mod memory; mod work; mod error;\npub use core::engine::CudaEngine;\npub use error::Error;\npub use memory::tensor::DeviceTensor;\n#[cfg(feature = \"sim\")]\npub mod sim { pub use crate::driver::sim::SimDevice; }\n",
        ),
        ("error.rs", "pub struct Error;\n"),
        (
            "driver/mod.rs",
            "pub(crate) mod sim;\nuse crate::error::Error;\npub(crate) trait Driver {}\n",
        ),
        (
            "driver/sim.rs",
            "use super::Driver;\npub struct SimDevice;\n",
        ),
        (
            "core/mod.rs",
            "pub(crate) mod engine;\npub(crate) mod parts;\n",
        ),
        (
            "core/parts.rs",
            "use crate::driver::Driver;\npub(crate) trait Part { fn teardown(&mut self, driver: &mut dyn Driver); }\npub(crate) struct Parts;\n",
        ),
        (
            "core/engine.rs",
            "use crate::driver::Driver;\nuse super::parts::Parts;\npub struct CudaEngine { parts: Parts }\n",
        ),
        (
            "memory/mod.rs",
            "pub(crate) mod pool;\npub(crate) mod tensor;\n",
        ),
        (
            "memory/pool.rs",
            "use crate::core::parts::Part;\nuse crate::driver::Driver;\npub(crate) struct Pool;\nimpl Part for Pool {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        ),
        (
            "memory/tensor.rs",
            "use crate::core::engine::CudaEngine;\nuse super::pool::Pool;\n// A comment may name crate::work::kernels::cache::Cache.\nconst S: &str = \"crate::work::kernels\";\npub struct DeviceTensor<'a>(&'a CudaEngine);\n",
        ),
        (
            "work/mod.rs",
            "pub(crate) mod kernels;\npub(crate) mod ops;\n",
        ),
        (
            "work/kernels/mod.rs",
            "pub(crate) mod cache;\npub(crate) mod spec_free;\n",
        ),
        (
            "work/kernels/cache.rs",
            "use crate::{core::parts::Part, driver::Driver, error::Error};\nuse super::spec_free::Spec;\npub(crate) struct Cache;\n",
        ),
        (
            "work/kernels/spec_free.rs",
            "use crate::Error;\npub(crate) struct Spec;\n",
        ),
        (
            "work/ops.rs",
            "use crate::{CudaEngine, DeviceTensor};\nuse crate::memory::{pool::Pool, tensor};\nfn f() { let _ = crate::sim::SimDevice; }\n",
        ),
    ]
}

fn check(files: &[(&str, &str)]) -> Vec<String> {
    Tree::from_files(files).violations()
}

/// The good tree with `file` replaced (or added).
fn good_tree_with(file: &'static str, text: &'static str) -> Vec<(&'static str, &'static str)> {
    let mut files = good_tree();
    files.retain(|(name, _)| *name != file);
    files.push((file, text));
    files
}

/// The violations of the good tree with `file` replaced (or added).
fn check_with(file: &'static str, text: &'static str) -> Vec<String> {
    check(&good_tree_with(file, text))
}

fn assert_caught(violations: &[String], needle: &str) {
    assert!(
        violations.iter().any(|v| v.contains(needle)),
        "expected a violation containing {needle:?}, got {violations:#?}"
    );
}

#[test]
fn checker_passes_a_tree_that_keeps_the_rules() {
    assert_eq!(check(&good_tree()), Vec::<String>::new());
    // The parts name the core's trait, and the core names none of them.
    let tree = Tree::from_files(&good_tree());
    assert!(tree.targets("memory/pool.rs").contains("core/parts.rs"));
    assert!(
        tree.targets("work/kernels/cache.rs")
            .contains("core/parts.rs")
    );
    assert_eq!(
        tree.targets("core/engine.rs"),
        BTreeSet::from(["driver/mod.rs", "core/parts.rs"])
    );
}

#[test]
fn checker_catches_the_seam_naming_the_engine() {
    let v = check_with(
        "driver/sim.rs",
        "/// Driven by [`CudaEngine`](crate::CudaEngine).\npub struct SimDevice;\n",
    );
    assert_caught(&v, "driver/sim.rs mentions `CudaEngine`");
    let v = check_with(
        "driver/sim.rs",
        "fn f(d: &mut dyn crate::work::kernels::spec_free::Spec) {}\n",
    );
    assert_caught(&v, "driver/sim.rs mentions `crate::work`");
    assert_caught(
        &v,
        "driver/sim.rs:1: the seam names work/kernels/spec_free.rs",
    );
}

#[test]
fn checker_catches_the_core_naming_the_state_above_it() {
    // The engine holding a subsystem's state by its type names a level above: caught, whether
    // named directly, in a group, through a root re-export or in code.
    for (text, needle) in [
        (
            "use crate::memory::pool::Pool;\nuse super::parts::Parts;\npub struct CudaEngine { pool: Pool, parts: Parts }\n",
            "core/engine.rs:1: core names memory/pool.rs (memory, a higher level) through `crate::memory::pool::Pool`",
        ),
        (
            "use super::parts::Parts;\nuse crate::{driver::Driver, work::kernels::cache::Cache};\n",
            "core/engine.rs:2: core names work/kernels/cache.rs (work, a higher level)",
        ),
        (
            "fn f(t: &crate::DeviceTensor) {}\n",
            "core/engine.rs:1: core names memory/tensor.rs",
        ),
        (
            "fn f() { crate::work::kernels::cache::Cache::default(); }\n",
            "core/engine.rs:1: core names work/kernels/cache.rs",
        ),
    ] {
        assert_caught(&check_with("core/engine.rs", text), needle);
    }
    // The part trait's own file is the core too.
    let v = check_with(
        "core/parts.rs",
        "use crate::memory::pool::Pool;\npub(crate) trait Part {}\n",
    );
    assert_caught(&v, "core/parts.rs:1: core names memory/pool.rs");
    // A part that knows the engine points down: no violation.
    let v = check_with(
        "memory/pool.rs",
        "use crate::core::engine::CudaEngine;\nuse crate::core::parts::Part;\npub(crate) struct Pool;\nimpl Part for Pool {}\nfn f(e: &CudaEngine) {}\n",
    );
    assert_eq!(v, Vec::<String>::new());
}

#[test]
fn checker_catches_an_import_from_a_higher_level() {
    // Directly, in a group, through a root re-export, through `super::super`, through a child
    // module's path, and in code rather than a `use`.
    for (text, needle) in [
        (
            "use crate::work::kernels::cache::Cache;\n",
            "memory/tensor.rs:1: memory names work/kernels/cache.rs (work, a higher level)",
        ),
        (
            "use crate::{driver::Driver, work::{kernels::cache::Cache, ops}};\n",
            "memory/tensor.rs:1: memory names work/kernels/cache.rs",
        ),
        (
            "fn f() { crate::DeviceTensor::new(); }\nfn g() -> crate::sim::SimDevice {}\n",
            "",
        ),
        (
            "use super::super::work::ops;\n",
            "memory/tensor.rs:1: memory names work/ops.rs",
        ),
        (
            "fn f() { let x = crate::work::ops::run(); }\n",
            "memory/tensor.rs:1: memory names work/ops.rs",
        ),
    ] {
        let v = check_with("memory/tensor.rs", text);
        if needle.is_empty() {
            // Same level and lower: no violation.
            assert_eq!(v, Vec::<String>::new(), "{text}");
        } else {
            assert_caught(&v, needle);
        }
    }
    // A root re-export is followed to what it re-exports.
    let v = check_with("driver/mod.rs", "fn f(e: &crate::DeviceTensor) {}\n");
    assert_caught(&v, "driver/mod.rs:1: the seam names memory/tensor.rs");
    // A path through a child module is resolved from the file's own module.
    let v = check_with(
        "memory/mod.rs",
        "pub(crate) mod pool;\npub(crate) mod tensor;\nfn f() { tensor::g(); }\n",
    );
    assert_eq!(v, Vec::<String>::new());
    let v = check_with(
        "memory/mod.rs",
        "pub(crate) mod pool;\npub(crate) mod tensor;\nfn f() { pool::g(); }\nuse crate::elsewhere::X;\n",
    );
    assert_caught(
        &v,
        "memory/mod.rs:4: `crate::elsewhere::X` resolves to no file",
    );
    // The base names nothing above it.
    let v = check_with("error.rs", "use crate::memory::tensor::DeviceTensor;\n");
    assert_caught(&v, "error.rs:1: the base names memory/tensor.rs");
}

#[test]
fn checker_catches_a_cycle_through_the_core_at_its_edge_up() {
    // The cache names an engine-free file of its own level, which names the engine (both
    // allowed); an engine that names the cache closes the cycle engine -> cache -> spec_free ->
    // engine, caught at its one edge that points up, and only there.
    let mut files = good_tree_with(
        "work/kernels/spec_free.rs",
        "use crate::core::engine::CudaEngine;\npub(crate) struct Spec;\n",
    );
    assert_eq!(check(&files), Vec::<String>::new());
    files.retain(|(name, _)| *name != "core/engine.rs");
    files.push((
        "core/engine.rs",
        "use super::parts::Parts;\nuse crate::work::kernels::cache::Cache;\npub struct CudaEngine { cache: Cache }\n",
    ));
    let v = check(&files);
    assert_caught(
        &v,
        "core/engine.rs:2: core names work/kernels/cache.rs (work, a higher level)",
    );
    assert_eq!(v.len(), 1, "{v:#?}");
    // Through the parent module: engine -> kernels/mod.rs -> engine.
    let mut files = good_tree_with(
        "work/kernels/mod.rs",
        "pub(crate) mod cache;\npub(crate) mod spec_free;\nuse crate::core::engine::CudaEngine;\npub(crate) struct Helper;\n",
    );
    assert_eq!(check(&files), Vec::<String>::new());
    files.retain(|(name, _)| *name != "core/engine.rs");
    files.push((
        "core/engine.rs",
        "fn f() -> crate::work::kernels::Helper {}\n",
    ));
    assert_caught(
        &check(&files),
        "core/engine.rs:1: core names work/kernels/mod.rs (work, a higher level)",
    );
}

#[test]
fn checker_skips_comments_strings_and_test_scopes_correctly() {
    // Paths in comments and literals are not code, even where code naming them would be a
    // violation (the pool is below the work level).
    let pool = "pub(crate) struct Pool;\nmod tests {\n    use super::*;\n    /* crate::work::ops */\n    const X: &str = r#\"crate::work::ops\"#;\n    const C: char = '\"';\n    fn f<'a>(x: &'a str) -> &'a str { x }\n}\n";
    let files = good_tree_with("memory/pool.rs", pool);
    assert_eq!(check(&files), Vec::<String>::new());
    // `super` inside an inline module is the file's own module, not its parent.
    let tree = Tree::from_files(&files);
    assert_eq!(
        tree.targets("memory/pool.rs"),
        BTreeSet::from(["memory/pool.rs"])
    );
    // The same path in code is seen (the control).
    let v = check_with(
        "memory/pool.rs",
        "pub(crate) struct Pool;\nmod tests {\n    use super::*;\n    use crate::work::ops;\n}\n",
    );
    assert_caught(&v, "memory/pool.rs:4: memory names work/ops.rs");
}

#[test]
fn checker_refuses_files_outside_the_levels() {
    let mut files = good_tree();
    files.push(("helpers.rs", "pub(crate) fn f() {}\n"));
    assert_caught(&check(&files), "helpers.rs lies outside the levels");
}

// ---------------------------------------------------------------------------------------------
// Reading sources.

/// One token of Rust code; comments, literals and whitespace are dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Open,
    Close,
    Comma,
    Semi,
    Star,
    Other,
}

/// Splits Rust source into tokens with their line numbers, dropping comments and string, byte
/// string, raw string and character literals (lifetimes are not literals).
fn tokens(text: &str) -> Vec<(Tok, usize)> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let newlines = |from: usize, to: usize| chars[from..to].iter().filter(|&&c| c == '\n').count();
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let start = i;
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            line += newlines(start, i);
        } else if c == '"' {
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            line += newlines(start, i.min(chars.len()));
        } else if c == '\'' {
            if next == Some('\\') {
                // An escaped character literal.
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if chars.get(i + 2) == Some(&'\'') {
                // A plain character literal.
                i += 3;
            } else {
                // A lifetime or label.
                i += 1;
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
            }
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let quote = chars.get(i).copied();
            let raw_prefix = matches!(word.as_str(), "r" | "br" | "cr");
            if raw_prefix && matches!(quote, Some('"' | '#')) {
                // A raw string: r"…", r#"…"#, with any number of hashes.
                let mut hashes = 0;
                while chars.get(i) == Some(&'#') {
                    hashes += 1;
                    i += 1;
                }
                if chars.get(i) != Some(&'"') {
                    // `r#ident`, a raw identifier.
                    continue;
                }
                let start = i;
                i += 1;
                'scan: while i < chars.len() {
                    if chars[i] == '"' && (1..=hashes).all(|k| chars.get(i + k) == Some(&'#')) {
                        i += 1 + hashes;
                        break 'scan;
                    }
                    i += 1;
                }
                line += newlines(start, i.min(chars.len()));
            } else if matches!(word.as_str(), "b" | "c") && quote == Some('"') {
                // A byte or C string: the `"` is handled as a string next.
            } else if word == "b" && quote == Some('\'') {
                // A byte literal: the `'` is handled as a character next.
            } else {
                out.push((Tok::Ident(word), line));
            }
        } else if c == ':' && next == Some(':') {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((
                match c {
                    '{' => Tok::Open,
                    '}' => Tok::Close,
                    ',' => Tok::Comma,
                    ';' => Tok::Semi,
                    '*' => Tok::Star,
                    _ => Tok::Other,
                },
                line,
            ));
            i += 1;
        }
    }
    out
}

/// A path into the crate named by a file: absolute module segments (from the crate root), and
/// where.
#[derive(Clone, Debug)]
struct Named {
    path: Vec<String>,
    line: usize,
    /// The alias it is imported under (`as`), or its last segment.
    name: Option<String>,
}

/// The paths into the crate that `toks` name, for a file of module `module` whose child modules
/// are `children`.
fn named_paths(
    toks: &[(Tok, usize)],
    module: &[String],
    children: &BTreeSet<String>,
) -> Vec<Named> {
    let ident = |k: usize| match toks.get(k) {
        Some((Tok::Ident(s), _)) => Some(s.as_str()),
        _ => None,
    };
    let is = |k: usize, t: Tok| toks.get(k).map(|(x, _)| x) == Some(&t);
    let mut out = Vec::new();
    // Inline modules (`mod tests { … }`) the scan is inside: (name, brace depth inside it).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut k = 0;
    while k < toks.len() {
        match &toks[k].0 {
            Tok::Open => depth += 1,
            Tok::Close => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Tok::Ident(word) if word == "mod" && ident(k + 1).is_some() && is(k + 2, Tok::Open) => {
                inline.push((ident(k + 1).unwrap_or_default().to_owned(), depth + 1));
            }
            _ => {}
        }
        let here: Vec<String> = module
            .iter()
            .cloned()
            .chain(inline.iter().map(|(n, _)| n.clone()))
            .collect();
        let after_path = k > 0 && is(k - 1, Tok::Path);
        let start = match ident(k) {
            Some("crate") if is(k + 1, Tok::Path) && !after_path => Some((Vec::new(), k + 2)),
            Some("self") if is(k + 1, Tok::Path) && !after_path => Some((here.clone(), k + 2)),
            Some("super") if is(k + 1, Tok::Path) && !after_path => {
                let mut base = here.clone();
                let mut j = k;
                while ident(j) == Some("super") && is(j + 1, Tok::Path) {
                    base.pop();
                    j += 2;
                }
                Some((base, j))
            }
            Some(child)
                if inline.is_empty()
                    && children.contains(child)
                    && is(k + 1, Tok::Path)
                    && !after_path
                    && !is(k.wrapping_sub(1), Tok::Other) =>
            {
                Some((here.clone(), k))
            }
            _ => None,
        };
        if let Some((prefix, at)) = start {
            let line = toks[k].1;
            let end = use_tree(toks, at, prefix, line, &mut out);
            k = end.max(k + 1);
            continue;
        }
        k += 1;
    }
    out
}

/// Parses the use tree (or path) at `k` under `prefix`, pushing its leaves; returns the index
/// after it.
fn use_tree(
    toks: &[(Tok, usize)],
    mut k: usize,
    mut prefix: Vec<String>,
    line: usize,
    out: &mut Vec<Named>,
) -> usize {
    loop {
        match toks.get(k).map(|(t, _)| t) {
            Some(Tok::Open) => {
                k += 1;
                loop {
                    match toks.get(k).map(|(t, _)| t) {
                        Some(Tok::Close) => return k + 1,
                        Some(Tok::Comma) => k += 1,
                        None => return k,
                        Some(_) => {
                            let line = toks[k].1;
                            let end = use_tree(toks, k, prefix.clone(), line, out);
                            k = end.max(k + 1);
                        }
                    }
                }
            }
            Some(Tok::Star) => {
                out.push(Named {
                    path: prefix,
                    line,
                    name: None,
                });
                return k + 1;
            }
            Some(Tok::Ident(word)) => {
                let word = word.clone();
                if word == "self" && !matches!(toks.get(k + 1), Some((Tok::Path, _))) {
                    let name = prefix.last().cloned();
                    out.push(Named {
                        path: prefix,
                        line,
                        name,
                    });
                    return k + 1;
                }
                prefix.push(word.clone());
                if matches!(toks.get(k + 1), Some((Tok::Path, _))) {
                    k += 2;
                    continue;
                }
                let alias = match (toks.get(k + 1), toks.get(k + 2)) {
                    (Some((Tok::Ident(a), _)), Some((Tok::Ident(b), _))) if a == "as" => {
                        k += 2;
                        b.clone()
                    }
                    _ => word,
                };
                out.push(Named {
                    path: prefix,
                    line,
                    name: Some(alias),
                });
                return k + 1;
            }
            _ => {
                if !prefix.is_empty() {
                    out.push(Named {
                        path: prefix,
                        line,
                        name: None,
                    });
                }
                return k;
            }
        }
    }
}

/// One source file.
struct Source {
    text: String,
    /// Paths into the crate it names, resolved: (line, the absolute path, the file).
    edges: Vec<(usize, String, String)>,
    /// Paths into the crate it names that resolve to no file: (line, the absolute path).
    unresolved: Vec<(usize, String)>,
}

/// What a path into the crate resolves to.
enum Resolved {
    /// The file that defines it.
    File(String),
    /// Another crate, re-exported at the root.
    External,
    /// Nothing the checker knows.
    Unknown,
}

/// The crate's source files, by path relative to `src/`.
struct Tree {
    files: BTreeMap<String, Source>,
}

/// The module path of a file: `memory/pool.rs` is `memory::pool`, `work/libs/mod.rs` is
/// `work::libs`, `lib.rs` the root.
fn module_of(file: &str) -> Vec<String> {
    let stem = file.strip_suffix(".rs").unwrap_or(file);
    let stem = stem.strip_suffix("/mod").unwrap_or(stem);
    if stem == "lib" {
        return Vec::new();
    }
    stem.split('/').map(str::to_owned).collect()
}

impl Tree {
    fn read(root: &Path) -> Tree {
        let mut files = Vec::new();
        let mut dirs = vec![root.to_path_buf()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("src/ is readable") {
                let path = entry.expect("a directory entry").path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let rel = path.strip_prefix(root).expect("under src/");
                    let rel = rel.to_string_lossy().replace('\\', "/");
                    let text = std::fs::read_to_string(&path).expect("a source file is readable");
                    files.push((rel, text));
                }
            }
        }
        let files: Vec<(&str, &str)> = files
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        Tree::from_files(&files)
    }

    fn from_files(files: &[(&str, &str)]) -> Tree {
        let modules: BTreeMap<Vec<String>, String> = files
            .iter()
            .map(|(file, _)| (module_of(file), (*file).to_owned()))
            .collect();
        let parsed: BTreeMap<String, Vec<Named>> = files
            .iter()
            .map(|(file, text)| {
                let toks = tokens(text);
                let children: BTreeSet<String> = toks
                    .windows(3)
                    .filter_map(|w| match (&w[0].0, &w[1].0, &w[2].0) {
                        (Tok::Ident(m), Tok::Ident(name), Tok::Semi) if m == "mod" => {
                            Some(name.clone())
                        }
                        _ => None,
                    })
                    .collect();
                (
                    (*file).to_owned(),
                    named_paths(&toks, &module_of(file), &children),
                )
            })
            .collect();
        // The root's re-exports (`pub use`), by the name they have at the root, and its inline
        // modules (`pub mod sim { … }`), by the module their re-exports come from.
        let root_modules: BTreeSet<String> = modules
            .keys()
            .filter(|m| m.len() == 1)
            .map(|m| m[0].clone())
            .collect();
        let mut root_names: BTreeMap<String, Vec<String>> = BTreeMap::new();
        if let Some((_, text)) = files.iter().find(|(f, _)| *f == "lib.rs") {
            let toks = tokens(text);
            for (k, (tok, _)) in toks.iter().enumerate() {
                match tok {
                    Tok::Ident(word) if word == "use" => {
                        let mut leaves = Vec::new();
                        use_tree(&toks, k + 1, Vec::new(), 0, &mut leaves);
                        for mut leaf in leaves {
                            if leaf.path.first().is_some_and(|s| s == "crate") {
                                leaf.path.remove(0);
                            }
                            if let Some(name) = leaf.name {
                                root_names.entry(name).or_insert(leaf.path);
                            }
                        }
                    }
                    Tok::Ident(word) if word == "mod" => {
                        let (Some((Tok::Ident(name), _)), Some((Tok::Open, _))) =
                            (toks.get(k + 1), toks.get(k + 2))
                        else {
                            continue;
                        };
                        let mut depth = 0;
                        let block = toks[k + 2..]
                            .iter()
                            .take_while(|(t, _)| {
                                match t {
                                    Tok::Open => depth += 1,
                                    Tok::Close => depth -= 1,
                                    _ => {}
                                }
                                depth > 0
                            })
                            .cloned()
                            .collect::<Vec<_>>();
                        let inner = named_paths(&block, &[], &BTreeSet::new());
                        if let Some(first) = inner.into_iter().find(|n| n.path.len() > 1) {
                            let module = first.path[..first.path.len() - 1].to_vec();
                            root_names.insert(name.clone(), module);
                        }
                    }
                    _ => {}
                }
            }
        }
        let resolve = |path: &[String]| -> Resolved {
            let mut path = path.to_vec();
            for _ in 0..8 {
                for k in (1..=path.len()).rev() {
                    if let Some(file) = modules.get(&path[..k]) {
                        return Resolved::File(file.clone());
                    }
                }
                let Some(target) = path.first().and_then(|first| root_names.get(first)) else {
                    return Resolved::Unknown;
                };
                if !target.first().is_some_and(|m| root_modules.contains(m)) {
                    // A re-export of another crate (`pub use cudarc;`, `half::f16`).
                    return Resolved::External;
                }
                path = target.iter().chain(&path[1..]).cloned().collect();
            }
            Resolved::Unknown
        };
        let files = files
            .iter()
            .map(|(file, text)| {
                let mut edges = Vec::new();
                let mut unresolved = Vec::new();
                for named in &parsed[*file] {
                    let path = named.path.join("::");
                    match resolve(&named.path) {
                        Resolved::File(target) => edges.push((named.line, path, target)),
                        Resolved::External => {}
                        Resolved::Unknown => unresolved.push((named.line, path)),
                    }
                }
                (
                    (*file).to_owned(),
                    Source {
                        text: (*text).to_owned(),
                        edges,
                        unresolved,
                    },
                )
            })
            .collect();
        Tree { files }
    }

    /// The files `file` names.
    fn targets(&self, file: &str) -> BTreeSet<&str> {
        self.files
            .get(file)
            .map(|s| s.edges.iter().map(|(_, _, t)| t.as_str()).collect())
            .unwrap_or_default()
    }

    fn violations(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (file, source) in &self.files {
            let Some(file_rank) = rank(file) else {
                if !NOT_LEVELS.contains(&file.as_str()) {
                    out.push(format!(
                        "{file} lies outside the levels: put it in one of {LEVELS:?}"
                    ));
                }
                continue;
            };
            // 1. The seam mentions nothing above it.
            if file.starts_with("driver/") {
                for word in NOT_IN_THE_SEAM {
                    if source.text.contains(word) {
                        out.push(format!(
                            "{file} mentions `{word}`: the seam knows no level above it"
                        ));
                    }
                }
            }
            // A path the checker cannot follow could hide anything: refuse it.
            for (line, path) in &source.unresolved {
                out.push(format!(
                    "{file}:{line}: `crate::{path}` resolves to no file the checker knows; name it by its module path"
                ));
            }
            // 2. Nothing names a higher level.
            for (line, path, target) in &source.edges {
                let Some(target_rank) = rank(target) else {
                    continue;
                };
                if target_rank <= file_rank {
                    continue;
                }
                out.push(format!(
                    "{file}:{line}: {} names {target} ({}, a higher level) through `crate::{path}`",
                    level_name(file_rank),
                    level_name(target_rank)
                ));
            }
        }
        out
    }
}

/// The rank of a file's level: 0 for the base, 1 for the seam, up to 6 for work; `None` for the
/// root, the guide and files outside the levels.
fn rank(file: &str) -> Option<usize> {
    if BASE.contains(&file) {
        return Some(0);
    }
    let top = file.split('/').next()?;
    if top == file {
        return None;
    }
    LEVELS.iter().position(|l| *l == top).map(|i| i + 1)
}

fn level_name(rank: usize) -> &'static str {
    match rank {
        0 => "the base",
        1 => "the seam",
        r => LEVELS[r - 1],
    }
}
