//! Which databases the dispatchers serve: the value of `outbox.database`.
//!
//! One name (as before), a comma-separated list, or `*` for every database
//! that has the extension. Names are taken as written (database names are
//! case-sensitive); one that holds a comma, a double quote or blanks at
//! either end is written in double quotes, a double quote inside doubled,
//! as in SQL.

/// A database name's longest, in bytes (PostgreSQL's `NAMEDATALEN` - 1).
pub const NAME_BYTES: usize = 63;

/// What `outbox.database` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Served {
    /// Every database that allows connections and is not a template.
    All,
    /// These, without repeats, in the order given.
    Named(Vec<String>),
}

impl Served {
    /// Parses a value of `outbox.database`; the error says what is wrong
    /// with it, for the setting's check.
    pub fn parse(setting: &str) -> Result<Served, String> {
        if setting.trim() == "*" {
            return Ok(Served::All);
        }
        let mut names: Vec<String> = Vec::new();
        for name in split(setting)? {
            if name.is_empty() {
                return Err("an empty database name in the list".into());
            }
            if name.len() > NAME_BYTES {
                return Err(format!(
                    "database name \"{name}\" is {} bytes, the limit is {NAME_BYTES}",
                    name.len()
                ));
            }
            if !names.contains(&name) {
                names.push(name);
            }
        }
        Ok(Served::Named(names))
    }

    /// Is the database `name` served?
    pub fn covers(&self, name: &str) -> bool {
        match self {
            Served::All => true,
            Served::Named(names) => names.iter().any(|n| n == name),
        }
    }
}

/// Splits on commas outside double quotes; trims unquoted items.
fn split(setting: &str) -> Result<Vec<String>, String> {
    let mut items = Vec::new();
    let mut chars = setting.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut item = String::new();
        if chars.next_if_eq(&'"').is_some() {
            loop {
                match chars.next() {
                    Some('"') if chars.next_if_eq(&'"').is_some() => item.push('"'),
                    Some('"') => break,
                    Some(c) => item.push(c),
                    None => return Err("a database name's closing double quote is missing".into()),
                }
            }
            while chars.next_if(|c| c.is_whitespace()).is_some() {}
            if !matches!(chars.peek(), None | Some(',')) {
                return Err(format!("a comma must follow the quoted database name \"{item}\""));
            }
        } else {
            while let Some(c) = chars.next_if(|&c| c != ',') {
                item.push(c);
            }
            item.truncate(item.trim_end().len());
        }
        items.push(item);
        if chars.next().is_none() {
            return Ok(items);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(names: &[&str]) -> Served {
        Served::Named(names.iter().map(|n| n.to_string()).collect())
    }

    #[test]
    fn one_name_a_list_or_every_database() {
        assert_eq!(Served::parse("postgres"), Ok(named(&["postgres"])));
        assert_eq!(Served::parse(" app , billing,app"), Ok(named(&["app", "billing"])));
        assert_eq!(Served::parse(" * "), Ok(Served::All));
        assert!(Served::parse("*").unwrap().covers("anything"));
        assert!(!named(&["App"]).covers("app"));
    }

    #[test]
    fn quoted_names_keep_commas_quotes_and_blanks() {
        assert_eq!(Served::parse(r#""a,b", "say ""hi"" ", c"#), Ok(named(&["a,b", "say \"hi\" ", "c"])));
        assert_eq!(Served::parse(r#""*""#), Ok(named(&["*"])));
    }

    #[test]
    fn bad_lists_say_what_is_wrong() {
        assert_eq!(Served::parse("app,,billing"), Err("an empty database name in the list".into()));
        assert_eq!(Served::parse(""), Err("an empty database name in the list".into()));
        assert_eq!(
            Served::parse(r#""open"#),
            Err("a database name's closing double quote is missing".into())
        );
        assert_eq!(
            Served::parse(r#""a" b"#),
            Err("a comma must follow the quoted database name \"a\"".into())
        );
        let long = "d".repeat(64);
        assert_eq!(
            Served::parse(&long),
            Err(format!("database name \"{long}\" is 64 bytes, the limit is 63"))
        );
    }
}
