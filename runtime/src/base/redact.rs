//! Hiding passwords in connection strings, and in messages that quote one.
//!
//! One function, [`redact`], used for every URL that reaches a log line, an error
//! message or a `Debug` output, and for every driver message that may quote a URL
//! (lapin's "Invalid URL: '…'" does). When a string is ambiguous it hides more, not
//! less: a password must never survive, a host name may.
//!
//! It scans text rather than parsing URLs (URLs are *edited* with the `url` crate):
//! what must be redacted most is the URL that does not parse — a raw `@` in a
//! password, a missing `//` — inside a driver's message, where a parser finds nothing
//! and would print it whole.

/// What replaces a secret.
const HIDDEN: &str = "***";

/// Returns `text` with every password it holds replaced by `***`.
///
/// `text` may be a connection string, a comma-separated list of them, or a message
/// quoting any of these. Hidden are:
///
/// - the password of every `scheme://user:password@host/…` URL, where the userinfo
///   runs to the **last** `@` of the URL, so a raw `@`, `:`, `/`, `?` or `#` in a
///   password hides it whole (the host may be hidden with it); a percent-encoded
///   password is hidden like any other;
/// - a `host:port` whose port is not a number, in a URL without `@` (a password
///   whose `@` was percent-encoded away, `postgres://user:pass%40host/db`);
/// - the value of every secret query parameter (`?password=`, `&sslpassword=`, any
///   name holding `pass`, `secret` or `token`, percent-encoded names too), up to the
///   next `&name=`;
/// - the value of every secret `key=value` pair of a libpq connection string
///   (`host=h password=secret`, `password = 'a b'`, quotes and `\'` escapes
///   understood);
/// - in any other word shaped `…:password@host` (a URL written without `//`,
///   `amqp:guest:secret@host`), everything from its first `:` to its last `@`.
///
/// A URL ends at whitespace or at a comma that starts another `scheme://` (a list
/// like `AMQP_URL=amqp://u:p@h1,amqp://u:p@h2` has each URL redacted).
///
/// ```
/// assert_eq!(idemq::connect::redact("amqp://guest:s3cr@t@h:5672/%2f"), "amqp://guest:***@h:5672/%2f");
/// assert_eq!(idemq::connect::redact("host=h password='a b' dbname=x"), "host=h password=*** dbname=x");
/// ```
pub fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some((start, authority)) = find_url(rest) {
        out.push_str(&redact_plain(&rest[..start]));
        let end = url_end(rest, authority);
        out.push_str(&rest[start..authority]);
        out.push_str(&redact_after_scheme(&rest[authority..end]));
        rest = &rest[end..];
    }
    out.push_str(&redact_plain(rest));
    out
}

/// Redacts text outside `scheme://` URLs: `key=value` pairs, then bare `user:pass@host`.
fn redact_plain(s: &str) -> String {
    redact_bare_userinfo(&redact_pairs(s))
}

/// Hides `pass` in every whitespace-delimited word shaped `…:pass@host` (a URL with
/// no `//`, `amqp:guest:secret@host`, which lapin quotes back; or credentials written
/// without a scheme): everything from the first `:` to the last `@`.
fn redact_bare_userinfo(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut copied = 0;
    for word in s.split(char::is_whitespace) {
        // `word` is a slice of `s`: its offset is where it starts in `s`.
        let start = word.as_ptr() as usize - s.as_ptr() as usize;
        let Some(at) = word.rfind('@') else { continue };
        let Some(colon) = word[..at].find(':') else { continue };
        out.push_str(&s[copied..start + colon + 1]);
        out.push_str(HIDDEN);
        copied = start + at;
    }
    out.push_str(&s[copied..]);
    out
}

/// The first `scheme://` in `s`: where the scheme starts and the index after `://`.
/// A `://` with no scheme before it counts too (hide more, not less).
fn find_url(s: &str) -> Option<(usize, usize)> {
    let colon = s.find("://")?;
    let scheme_len = s.as_bytes()[..colon].iter().rev().take_while(|&&b| is_scheme_byte(b)).count();
    Some((colon - scheme_len, colon + 3))
}

fn is_scheme_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.')
}

/// Whether `s` opens with `scheme://`.
fn starts_with_url(s: &str) -> bool {
    matches!(find_url(s), Some((0, _)))
}

/// The end of the URL whose authority starts at `from`: whitespace, a comma that
/// starts another URL, or the end of `s`.
fn url_end(s: &str, from: usize) -> usize {
    for (i, c) in s[from..].char_indices() {
        let at = from + i;
        if c.is_whitespace() || (c == ',' && starts_with_url(s[at + 1..].trim_start())) {
            return at;
        }
    }
    s.len()
}

/// Redacts what follows `scheme://` in one URL.
fn redact_after_scheme(s: &str) -> String {
    // The query first: a secret parameter's value may hold `@` or `:` itself.
    let s = redact_query(s);
    if let Some(at) = s.rfind('@') {
        let userinfo = &s[..at];
        return match userinfo.find(':') {
            Some(colon) => format!("{}:{HIDDEN}{}", &userinfo[..colon], &s[at..]),
            // `user@host`: no password.
            None => s,
        };
    }
    let authority_end = s.find(['/', '?', '#']).unwrap_or(s.len());
    let authority = &s[..authority_end];
    if authority.split(',').any(has_non_numeric_port) {
        let colon = authority.find(':').unwrap_or(authority.len());
        return format!("{}:{HIDDEN}{}", &authority[..colon], &s[authority_end..]);
    }
    s
}

/// Whether `host:port` has a port that is not a number (then it is a password).
fn has_non_numeric_port(host: &str) -> bool {
    let port = match host.strip_prefix('[') {
        // IPv6: `[::1]:5432`.
        Some(v6) => v6.split_once(']').map_or("", |(_, rest)| rest.strip_prefix(':').unwrap_or("")),
        None => host.split_once(':').map_or("", |(_, port)| port),
    };
    !port.bytes().all(|b| b.is_ascii_digit())
}

/// Hides the values of secret `?name=`/`&name=` parameters anywhere in `s`.
fn redact_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut copied = 0;
    let mut search = 0;
    while let Some(sep) = s[search..].find(['?', '&']).map(|i| search + i) {
        search = sep + 1;
        let Some((name, value_start)) = query_param(s, sep + 1) else { continue };
        if !is_secret_name(&percent_decode(name)) {
            continue;
        }
        // The value runs to the next `&name=` (a raw `&` in a password stays hidden).
        let mut value_end = s.len();
        let mut from = value_start;
        while let Some(amp) = s[from..].find('&').map(|i| from + i) {
            if query_param(s, amp + 1).is_some() {
                value_end = amp;
                break;
            }
            from = amp + 1;
        }
        out.push_str(&s[copied..value_start]);
        out.push_str(HIDDEN);
        copied = value_end;
        search = value_end;
    }
    out.push_str(&s[copied..]);
    out
}

/// A parameter `name=` starting at `at`: the name and where its value starts.
fn query_param(s: &str, at: usize) -> Option<(&str, usize)> {
    let len = s[at..]
        .bytes()
        .take_while(|&b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'%'))
        .count();
    (len > 0 && s[at + len..].starts_with('=')).then(|| (&s[at..at + len], at + len + 1))
}

/// Hides the values of secret `key=value` pairs (libpq connection strings).
fn redact_pairs(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut copied = 0;
    let mut i = 0;
    while i < bytes.len() {
        if !is_word_byte(bytes[i]) || (i > 0 && is_word_byte(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let word_end = i + bytes[i..].iter().take_while(|&&b| is_word_byte(b)).count();
        let mut j = word_end;
        while j < bytes.len() && bytes[j] == b' ' {
            j += 1;
        }
        if j >= bytes.len() || bytes[j] != b'=' || !is_secret_name(&s[i..word_end]) {
            i = word_end;
            continue;
        }
        j += 1;
        while j < bytes.len() && bytes[j] == b' ' {
            j += 1;
        }
        let value_end = pair_value_end(bytes, j);
        out.push_str(&s[copied..j]);
        out.push_str(HIDDEN);
        copied = value_end;
        i = value_end;
    }
    out.push_str(&s[copied..]);
    out
}

/// The end of a libpq value starting at `start`: a quoted value to its closing quote
/// (to the end if unterminated), a bare one to whitespace.
fn pair_value_end(bytes: &[u8], start: usize) -> usize {
    match bytes.get(start) {
        Some(&quote @ (b'\'' | b'"')) => {
            let mut k = start + 1;
            while k < bytes.len() {
                match bytes[k] {
                    b'\\' => k += 2,
                    b if b == quote => return k + 1,
                    _ => k += 1,
                }
            }
            bytes.len()
        }
        _ => start + bytes[start..].iter().take_while(|b| !b.is_ascii_whitespace()).count(),
    }
}

fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Whether a parameter named `name` holds a secret: `password`, `sslpassword`,
/// `passwd`, `pass`, `client_secret`, `token`…
fn is_secret_name(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["pass", "pwd", "secret", "token"].iter().any(|secret| name.contains(secret))
}

/// `%XX` decoded (ASCII only; anything else kept as written). For parameter names.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < bytes.len() {
        let decoded = (bytes[i] == b'%')
            .then(|| s.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok())
            .filter(u8::is_ascii);
        match decoded {
            Some(b) => {
                out.push(char::from(b));
                i += 3;
            }
            None => {
                out.push(char::from(bytes[i]));
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::redact;

    /// Asserts that `redact(input)` is `expected` and holds none of `secrets`.
    fn check(input: &str, expected: &str, secrets: &[&str]) {
        let redacted = redact(input);
        assert_eq!(redacted, expected, "redact({input:?})");
        for secret in secrets {
            assert!(!redacted.contains(secret), "{secret:?} survives in {redacted:?}");
        }
    }

    #[test]
    fn a_url_password_is_hidden_and_the_rest_kept() {
        check("amqp://guest:secret@h:5672/%2f", "amqp://guest:***@h:5672/%2f", &["secret"]);
        check("postgres://postgres@h/db", "postgres://postgres@h/db", &[]);
        check("postgres://h:5432/db", "postgres://h:5432/db", &[]);
        check("postgresql://u:@h/db", "postgresql://u:***@h/db", &[]);
    }

    #[test]
    fn a_password_holding_url_delimiters_is_hidden_whole() {
        check(
            "postgres://postgres:s3cr@t-pw@127.0.0.1:1/x",
            "postgres://postgres:***@127.0.0.1:1/x",
            &["s3cr", "t-pw"],
        );
        check("amqp://u:a:b@h/v", "amqp://u:***@h/v", &["a:b"]);
        check("amqp://u:pa/ss@h/v", "amqp://u:***@h/v", &["pa", "ss@"]);
        check("amqp://u:pa?ss@h/v", "amqp://u:***@h/v", &["pa?", "ss@"]);
        check("amqp://u:pa#ss@h/v", "amqp://u:***@h/v", &["pa#", "ss@"]);
        check("amqp://u:p@ss/wo?rd#x@h/v", "amqp://u:***@h/v", &["p@ss", "wo", "rd#x"]);
    }

    #[test]
    fn a_percent_encoded_password_is_hidden() {
        check("postgres://u:s3cr%40t%3Apw@h/db", "postgres://u:***@h/db", &["s3cr", "%40t", "pw@"]);
        // The `@` itself encoded: no separator left, the "port" is the password.
        check("postgres://u:s3cr%40h/db", "postgres://u:***/db", &["s3cr"]);
        check("postgres://[::1]:5432/db", "postgres://[::1]:5432/db", &[]);
        check("postgres://h1:5432,h2:5433/db", "postgres://h1:5432,h2:5433/db", &[]);
    }

    #[test]
    fn secret_query_parameters_are_hidden() {
        check("postgres://u@h/db?password=hunter2", "postgres://u@h/db?password=***", &["hunter2"]);
        check(
            "postgres://h/db?sslmode=require&sslpassword=k3y&application_name=a",
            "postgres://h/db?sslmode=require&sslpassword=***&application_name=a",
            &["k3y"],
        );
        check("postgres://h/db?user=u&password=a&b#c", "postgres://h/db?user=u&password=***", &["a&b", "#c"]);
        check("postgres://h/db?pass%77ord=x1y", "postgres://h/db?pass%77ord=***", &["x1y"]);
        check("postgres://h/db?password=x:y@z", "postgres://h/db?password=***", &["x:y", "@z"]);
        check("postgres://u:p@h/db?password=q", "postgres://u:***@h/db?password=***", &["p@", "=q"]);
        check("postgres://h/db?heartbeat=10", "postgres://h/db?heartbeat=10", &[]);
    }

    #[test]
    fn key_value_connection_strings_have_their_password_hidden() {
        check("host=h password=secret dbname=x", "host=h password=*** dbname=x", &["secret"]);
        check("host=h password='a b\\' c' user=u", "host=h password=*** user=u", &["a b", "c'"]);
        check("password = 'unterminated", "password = ***", &["unterminated"]);
        check("sslpassword=k3y host=h", "sslpassword=*** host=h", &["k3y"]);
        check("host=h port=5432", "host=h port=5432", &[]);
    }

    #[test]
    fn each_url_of_a_list_is_redacted() {
        check(
            "amqp://u:p1@h1/v,amqp://u:p@2@h2/v, amqps://u:p3@h3/v",
            "amqp://u:***@h1/v,amqp://u:***@h2/v, amqps://u:***@h3/v",
            &["p1", "p@2", "p3"],
        );
        // A comma that starts no URL belongs to the password.
        check("amqp://u:a,b@h/v", "amqp://u:***@h/v", &["a,b"]);
    }

    #[test]
    fn urls_quoted_in_messages_are_redacted() {
        check(
            "IO error: Invalid URL: 'amqp://guest:s3cr@t@h/%2f'",
            "IO error: Invalid URL: 'amqp://guest:***@h/%2f'",
            &["s3cr", "t@h"],
        );
        check(
            "connect to postgres://u:pw@h/postgres: role \"u\" does not exist",
            "connect to postgres://u:***@h/postgres: role \"u\" does not exist",
            &["pw"],
        );
        check("error connecting to server: timed out", "error connecting to server: timed out", &[]);
        check("no scheme ://u:p@h", "no scheme ://u:***@h", &["p@"]);
        check(
            "Invalid URL: 'amqp:guest:s3cr@t?heartbeat=20'",
            "Invalid URL: 'amqp:***@t?heartbeat=20'",
            &["s3cr", "guest:s"],
        );
        check("login guest:pw@h failed", "login guest:***@h failed", &["pw"]);
        check("mail me at a@b.c", "mail me at a@b.c", &[]);
    }
}
