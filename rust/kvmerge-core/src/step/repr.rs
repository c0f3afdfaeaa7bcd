//! Values as Python's `repr` writes them: the log lines and refusals that
//! name a setting show it as the operator wrote it in Python or JSON.

pub fn py_bool(b: bool) -> String {
    if b { "True" } else { "False" }.to_owned()
}

/// `repr(text)`, for the texts settings hold.
pub fn py_str(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(text.len() + 2);
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// `repr(tuple(factors))`.
pub fn py_factors(factors: &[i64]) -> String {
    match factors {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            factors
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_quoted_as_repr_does() {
        assert_eq!(py_str("it's"), "\"it's\"");
        assert_eq!(py_str("a'\"b"), "'a\\'\"b'");
        assert_eq!(py_factors(&[1, 2]), "(1, 2)");
    }
}
