//! Tables as text, column-wise: CSV as Python's `csv.writer` writes it (excel dialect) and
//! JSON rows as `json.dumps` writes a list of dicts, byte for byte, from columns of numbers,
//! flags and labels (the analysis's per-document table: 100k documents x 2 policies is 6M
//! numbers, seconds of Python per format, a fraction of a second here, all cores).
//!
//! Numbers are written as Python's `repr` writes a float (the shortest text that reads back
//! the same number, fixed notation for decimal exponents -4..16, `1e-05` style otherwise);
//! non-finite numbers are `nan`/`inf`/`-inf` in CSV and `null` in JSON (as the analysis's
//! JSON writes them). Labels are strings, quoted for the format as each row is written.

use std::fmt::Write as _;

use rayon::prelude::*;

use crate::error::{KvError, KvResult};

/// The text format of a table's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextFormat {
    /// `csv.writer(f)` rows: `,`-separated, minimal quoting, `\r\n` after each row.
    Csv,
    /// The rows of `json.dumps(list_of_dicts)` between its brackets: `{"key": value, ...}`
    /// joined by `, `.
    JsonRows,
}

/// Where a column's values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColumnSource {
    /// Column `j` of the numbers (`rows x width`, row-major).
    Number(usize),
    /// Column `j` of the flags.
    Flag(usize),
    /// Column `j` of the label codes, each an index into that column's labels.
    Label(usize),
}

/// A table of `rows` rows given column-wise.
pub struct TextTable<'a> {
    pub names: &'a [String],
    pub sources: &'a [ColumnSource],
    pub rows: usize,
    pub numbers: &'a [f64],
    pub number_width: usize,
    pub flags: &'a [bool],
    pub flag_width: usize,
    pub codes: &'a [u32],
    pub code_width: usize,
    pub labels: &'a [Vec<String>],
}

/// Rows per task: each formats its rows into its own buffer.
const CHUNK: usize = 2048;

impl TextTable<'_> {
    fn check(&self, start: usize, stop: usize) -> KvResult<()> {
        let shape = |what: &str, len: usize, width: usize| -> KvResult<()> {
            if len != self.rows * width {
                return Err(KvError::Shape(format!(
                    "{what} has {len} values, expected {} rows x {width}",
                    self.rows
                )));
            }
            Ok(())
        };
        shape("numbers", self.numbers.len(), self.number_width)?;
        shape("flags", self.flags.len(), self.flag_width)?;
        shape("codes", self.codes.len(), self.code_width)?;
        if self.labels.len() != self.code_width {
            return Err(KvError::Shape(format!(
                "{} label lists for {} label columns",
                self.labels.len(),
                self.code_width
            )));
        }
        if self.names.len() != self.sources.len() {
            return Err(KvError::Shape(format!(
                "{} names for {} columns",
                self.names.len(),
                self.sources.len()
            )));
        }
        for (name, source) in self.names.iter().zip(self.sources) {
            let (j, width) = match *source {
                ColumnSource::Number(j) => (j, self.number_width),
                ColumnSource::Flag(j) => (j, self.flag_width),
                ColumnSource::Label(j) => (j, self.code_width),
            };
            if j >= width {
                return Err(KvError::Shape(format!(
                    "column {name:?} reads {source:?} of {width}"
                )));
            }
        }
        if start > stop || stop > self.rows {
            return Err(KvError::InvalidArgument(format!(
                "rows {start}..{stop} of a table of {} rows",
                self.rows
            )));
        }
        // The codes of the rows asked for (a table is written a block of rows at a time).
        let asked = &self.codes[start * self.code_width..stop * self.code_width];
        for (j, labels) in self.labels.iter().enumerate() {
            let bad = asked
                .iter()
                .skip(j)
                .step_by(self.code_width.max(1))
                .find(|&&c| c as usize >= labels.len());
            if let Some(c) = bad {
                return Err(KvError::InvalidArgument(format!(
                    "label code {c} of column {j} beyond its {} labels",
                    labels.len()
                )));
            }
        }
        Ok(())
    }

    /// Rows `start..stop` as text in `format`.
    pub fn format(&self, format: TextFormat, start: usize, stop: usize) -> KvResult<Vec<u8>> {
        let json = format == TextFormat::JsonRows;
        let (csv_text, json_text) = self.format_as(start, stop, !json, json)?;
        Ok(if json { json_text } else { csv_text })
    }

    /// Rows `start..stop` as CSV and as JSON rows at once (each number formatted once for
    /// both): the same bytes as [`Self::format`] gives for each.
    pub fn format_both(&self, start: usize, stop: usize) -> KvResult<(Vec<u8>, Vec<u8>)> {
        self.format_as(start, stop, true, true)
    }

    /// The rows in the formats asked (an empty text for the other), chunk by chunk on all
    /// cores.
    fn format_as(
        &self,
        start: usize,
        stop: usize,
        csv: bool,
        json: bool,
    ) -> KvResult<(Vec<u8>, Vec<u8>)> {
        self.check(start, stop)?;
        let keys: Vec<String> = self
            .names
            .iter()
            .map(|n| {
                let mut key = String::new();
                push_json_string(n, &mut key);
                key + ": "
            })
            .collect();
        let chunks: Vec<(usize, usize)> = (start..stop)
            .step_by(CHUNK)
            .map(|a| (a, (a + CHUNK).min(stop)))
            .collect();
        let parts: Vec<(String, String)> = chunks
            .into_par_iter()
            .map(|(a, b)| {
                let size = (b - a) * 64 * self.sources.len().max(1);
                let mut out = RowText {
                    csv: csv.then(|| String::with_capacity(size)),
                    json: json.then(|| String::with_capacity(size)),
                    number: String::new(),
                };
                for r in a..b {
                    self.row(r, r == start, &keys, &mut out);
                }
                (out.csv.unwrap_or_default(), out.json.unwrap_or_default())
            })
            .collect();
        let joined = |text: &dyn Fn(&(String, String)) -> &String| {
            let mut out = Vec::with_capacity(parts.iter().map(|p| text(p).len()).sum());
            for p in &parts {
                out.extend_from_slice(text(p).as_bytes());
            }
            out
        };
        Ok((joined(&|p| &p.0), joined(&|p| &p.1)))
    }

    fn row(&self, r: usize, first: bool, keys: &[String], out: &mut RowText) {
        let RowText { csv, json, number } = out;
        if let Some(json) = json.as_mut() {
            json.push_str(if first { "{" } else { ", {" });
        }
        for (i, source) in self.sources.iter().enumerate() {
            if i > 0 {
                if let Some(csv) = csv.as_mut() {
                    csv.push(',');
                }
                if let Some(json) = json.as_mut() {
                    json.push_str(", ");
                }
            }
            if let Some(json) = json.as_mut() {
                json.push_str(&keys[i]);
            }
            match *source {
                ColumnSource::Number(j) => {
                    let x = self.numbers[r * self.number_width + j];
                    number.clear();
                    push_float_repr(x, number);
                    if let Some(csv) = csv.as_mut() {
                        csv.push_str(number);
                    }
                    if let Some(json) = json.as_mut() {
                        json.push_str(if x.is_finite() { number } else { "null" });
                    }
                }
                ColumnSource::Flag(j) => {
                    let f = self.flags[r * self.flag_width + j];
                    if let Some(csv) = csv.as_mut() {
                        csv.push_str(if f { "True" } else { "False" });
                    }
                    if let Some(json) = json.as_mut() {
                        json.push_str(if f { "true" } else { "false" });
                    }
                }
                ColumnSource::Label(j) => {
                    let label = &self.labels[j][self.codes[r * self.code_width + j] as usize];
                    if let Some(csv) = csv.as_mut() {
                        push_csv_field(label, csv);
                    }
                    if let Some(json) = json.as_mut() {
                        push_json_string(label, json);
                    }
                }
            }
        }
        if let Some(csv) = csv.as_mut() {
            csv.push_str("\r\n");
        }
        if let Some(json) = json.as_mut() {
            json.push('}');
        }
    }
}

/// Where a row's text goes: each format asked, and a buffer for a number's text.
struct RowText {
    csv: Option<String>,
    json: Option<String>,
    number: String,
}

/// `x` as Python's `repr(float)` writes it.
pub fn push_float_repr(x: f64, out: &mut String) {
    if x.is_nan() {
        out.push_str("nan");
        return;
    }
    if x.is_infinite() {
        out.push_str(if x > 0.0 { "inf" } else { "-inf" });
        return;
    }
    let mut buffer = ryu::Buffer::new();
    // Where Python writes fixed notation (decimal exponents -4..15), Ryu writes the same
    // text (the same shortest digits, laid out alike): taken as it is, the common case.
    if (1e-4..1e16).contains(&x.abs()) {
        out.push_str(buffer.format_finite(x));
        return;
    }
    if x.is_sign_negative() {
        out.push('-');
    }
    if x == 0.0 {
        out.push_str("0.0");
        return;
    }
    let mut bytes = [0u8; 24];
    let (len, exp) = shortest_digits(buffer.format_finite(x.abs()), &mut bytes);
    // ASCII digits only.
    let digits = std::str::from_utf8(&bytes[..len]).unwrap_or("0");
    let n = len as i32;
    let point = exp + 1; // digits before the decimal point
    if !(-4 < point && point <= 16) {
        out.push_str(&digits[..1]);
        if n > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        let e = exp.unsigned_abs();
        if e < 10 {
            out.push('0');
        }
        let _ = write!(out, "{e}");
    } else if point <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-point) as usize));
        out.push_str(digits);
    } else if point >= n {
        out.push_str(digits);
        out.extend(std::iter::repeat_n('0', (point - n) as usize));
        out.push_str(".0");
    } else {
        out.push_str(&digits[..point as usize]);
        out.push('.');
        out.push_str(&digits[point as usize..]);
    }
}

/// The significant digits (at most 17) and the decimal exponent of the first, of Ryu's text
/// of a positive number (`"12340000000.0"`, `"12.34"`, `"0.001234"`, `"1.234e-7"`, `"1e30"`):
/// the shortest digits that read back as the number, the nearest of them, an exact tie to
/// the even digit, as Python's `repr` takes them (David Gay's rule).
fn shortest_digits(text: &str, digits: &mut [u8; 24]) -> (usize, i32) {
    let (mantissa, exp) = match text.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (text, 0),
    };
    let (whole, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let mut n = 0;
    let mut lead = 0i32; // zeros between the point and the first digit ("0.001234")
    for &b in whole.as_bytes().iter().chain(frac.as_bytes()) {
        if n == 0 && b == b'0' {
            lead += 1;
            continue;
        }
        if n < digits.len() {
            digits[n] = b;
            n += 1;
        }
    }
    while n > 1 && digits[n - 1] == b'0' {
        n -= 1; // "12340000000.0"
    }
    // The first digit's place: whole digits before the point, less the zeros skipped.
    let first = whole.len() as i32 - lead - 1 + exp;
    (n, first)
}

/// A CSV field as `csv.writer` (QUOTE_MINIMAL) writes it: quoted, with quotes doubled, where
/// it holds a comma, a quote or a line break.
pub fn push_csv_field(s: &str, out: &mut String) {
    if s.contains([',', '"', '\r', '\n']) {
        out.push('"');
        out.push_str(&s.replace('"', "\"\""));
        out.push('"');
    } else {
        out.push_str(s);
    }
}

/// A JSON string as `json.dumps` writes it (`ensure_ascii`: every character beyond ASCII as
/// `\uXXXX`, in surrogate pairs beyond the basic plane).
pub fn push_json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repr(x: f64) -> String {
        let mut s = String::new();
        push_float_repr(x, &mut s);
        s
    }

    #[test]
    fn floats_as_python_writes_them() {
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1.5, "1.5"),
            (123.456, "123.456"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e22, "1.2345e+22"),
            (-2.5e-300, "-2.5e-300"),
            (0.9971650511147728, "0.9971650511147728"),
            (2129260214221147.0 + 0.25, "2129260214221147.2"), // a tie: the even digit
            (2129260214221147.0 + 0.75, "2129260214221147.8"),
            (f64::NAN, "nan"),
            (f64::INFINITY, "inf"),
            (f64::NEG_INFINITY, "-inf"),
        ];
        for (x, want) in cases {
            assert_eq!(repr(x), want, "{x:e}");
        }
    }

    fn csv_field(s: &str) -> String {
        let mut out = String::new();
        push_csv_field(s, &mut out);
        out
    }

    fn json_string(s: &str) -> String {
        let mut out = String::new();
        push_json_string(s, &mut out);
        out
    }

    #[test]
    fn strings_quoted_as_python_quotes_them() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(json_string("a\"b\\c\nd"), "\"a\\\"b\\\\c\\nd\"");
        assert_eq!(json_string("é😀\u{1}"), "\"\\u00e9\\ud83d\\ude00\\u0001\"");
    }

    #[test]
    fn rows_in_both_formats_and_bad_codes_refused() {
        let names: Vec<String> = ["id", "x", "ok"].iter().map(|s| s.to_string()).collect();
        let sources = [
            ColumnSource::Label(0),
            ColumnSource::Number(0),
            ColumnSource::Flag(0),
        ];
        let labels = vec![vec!["a".to_string(), "b,c".to_string()]];
        let mut table = TextTable {
            names: &names,
            sources: &sources,
            rows: 2,
            numbers: &[0.5, f64::NAN],
            number_width: 1,
            flags: &[true, false],
            flag_width: 1,
            codes: &[0, 1],
            code_width: 1,
            labels: &labels,
        };
        let csv = table.format(TextFormat::Csv, 0, 2).unwrap();
        assert_eq!(csv, b"a,0.5,True\r\n\"b,c\",nan,False\r\n");
        let json = table.format(TextFormat::JsonRows, 0, 2).unwrap();
        assert_eq!(
            String::from_utf8(json).unwrap(),
            "{\"id\": \"a\", \"x\": 0.5, \"ok\": true}, \
             {\"id\": \"b,c\", \"x\": null, \"ok\": false}"
        );
        // Both at once: the same bytes, for every range of rows.
        for (a, b) in [(0, 2), (0, 1), (1, 2), (1, 1)] {
            let both = table.format_both(a, b).unwrap();
            assert_eq!(both.0, table.format(TextFormat::Csv, a, b).unwrap());
            assert_eq!(both.1, table.format(TextFormat::JsonRows, a, b).unwrap());
        }
        assert!(table.format(TextFormat::Csv, 1, 3).is_err());
        assert!(table.format_both(1, 3).is_err());
        table.codes = &[0, 2];
        assert!(table.format_both(0, 2).is_err());
        assert!(table.format(TextFormat::Csv, 0, 2).is_err());
    }
}
