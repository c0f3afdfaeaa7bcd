//! The exceptions' docstrings are written once, in `_kvmerge.pyi` (IDEs and
//! stubtest read them there); the classes made at run time need them too.
//! This reads every top-level class's docstring from the stub into
//! `$OUT_DIR/pyi_docs.rs`, as the macro `pyi_doc!(Class)` that `errors.rs`
//! gives each exception. Asking it for a class with no docstring there (or
//! one this build cannot read) fails the compile, saying which and why.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;

/// Relative to the repository's root, two levels above this crate: maturin's
/// sdist keeps that layout, `python/` included.
const STUB: &str = "python/kvmerge/_kvmerge.pyi";

fn main() {
    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap()).join("../..");
    let stub = root.join(STUB);
    println!("cargo:rerun-if-changed={}", stub.display());
    let text = fs::read_to_string(&stub).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: the exceptions' docstrings are read from there",
            stub.display()
        )
    });
    let mut arms = String::new();
    for (class, doc) in class_docs(&text) {
        let expansion = match doc {
            Ok(doc) => format!("{doc:?}"),
            Err(why) => format!(
                "compile_error!({:?})",
                format!("{STUB}: class {class}: {why}")
            ),
        };
        writeln!(arms, "    ({class}) => {{ {expansion} }};").unwrap();
    }
    let source = format!(
        "/// The docstring of class `$class` in {STUB}, as Python's\n\
         /// `ast.get_docstring` reads it.\n\
         macro_rules! pyi_doc {{\n{arms}    ($other:ident) => {{ compile_error!(concat!(\n        \
         {STUB:?}, \": no class \", stringify!($other),\n        \
         \": each exception's docstring is written there once\"\n    )) }};\n}}\n"
    );
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join("pyi_docs.rs");
    fs::write(&out, source).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
}

/// Each top-level class and its docstring, or why there is none to take.
fn class_docs(text: &str) -> Vec<(&str, Result<String, &'static str>)> {
    let lines: Vec<&str> = text.split('\n').collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(header) = line.strip_prefix("class ") else {
            continue;
        };
        let end = header
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(header.len());
        // The body starts after the header's colon, which may be lines on.
        let body = lines[i..]
            .iter()
            .position(|l| l.trim_end().ends_with(':'))
            .map_or(&[][..], |colon| &lines[i + colon + 1..]);
        found.push((&header[..end], docstring(body)));
    }
    found
}

/// The docstring that opens a class body: a plain `"""` string, which this
/// reads without interpreting escapes or tabs (so it refuses both).
fn docstring(body: &[&str]) -> Result<String, &'static str> {
    let Some(open) = body.iter().position(|l| !l.trim().is_empty()) else {
        return Err("it has no body");
    };
    let Some(rest) = body[open].trim_start().strip_prefix("\"\"\"") else {
        return Err("its body does not open with a \"\"\" docstring");
    };
    let mut raw = rest.to_owned();
    let mut next = body[open + 1..].iter();
    loop {
        if let Some(end) = raw.find("\"\"\"") {
            raw.truncate(end);
            break;
        }
        let Some(line) = next.next() else {
            return Err("its docstring is not closed");
        };
        raw.push('\n');
        raw.push_str(line);
    }
    if raw.contains(['\\', '\t']) {
        return Err("its docstring has a backslash or a tab, which this build does not interpret");
    }
    Ok(clean(&raw))
}

/// Python's `inspect.cleandoc` (what `ast.get_docstring` returns): the first
/// line stripped, the others' common indent removed, empty lines at either
/// end dropped.
fn clean(raw: &str) -> String {
    let lines: Vec<&str> = raw.split('\n').collect();
    let margin = lines[1..]
        .iter()
        .filter(|l| !l.trim_start().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    let mut out = vec![lines[0].trim_start()];
    out.extend(lines[1..].iter().map(|l| l.get(margin..).unwrap_or("")));
    let start = out.iter().position(|l| !l.is_empty()).unwrap_or(out.len());
    let end = out
        .iter()
        .rposition(|l| !l.is_empty())
        .map_or(start, |i| i + 1);
    out[start..end].join("\n")
}
