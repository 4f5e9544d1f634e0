//! SASL as Kafka's brokers take it (KIP-43, KIP-84): PLAIN, and the
//! SCRAM-SHA-256 and SCRAM-SHA-512 client of RFC 5802 / RFC 7677. Pure: the
//! messages to send and the checks of what the server answered; the
//! exchange itself is the connection's (`wire.rs`).

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use ring::{digest, hmac, pbkdf2};

crate::named! {
    /// `outbox.kafka_sasl_mechanism`: how a user named in the URL
    /// authenticates; the first is the default.
    pub enum Mechanism {
        ScramSha512 = "SCRAM-SHA-512",
        ScramSha256 = "SCRAM-SHA-256",
        Plain = "PLAIN",
    }
}

/// The most PBKDF2 iterations a server may ask for: Kafka's own bound
/// (`ScramMechanism.maxIterations`). More would stall the dispatcher
/// (PBKDF2 does not wait on the latch) at a hostile server's word.
pub const MAX_ITERATIONS: u32 = 16_384;

/// PLAIN's only message: `\0user\0password` (RFC 4616).
pub fn plain(user: &str, password: &str) -> Vec<u8> {
    format!("\0{user}\0{password}").into_bytes()
}

/// A SCRAM exchange under way, from the client's first message.
pub struct Scram {
    sha512: bool,
    password: String,
    nonce: String,
    first_bare: String,
    /// The key and message the server's final signature must be of.
    server_proof: Option<(hmac::Key, String)>,
}

impl Scram {
    /// The exchange for `user` with the client's `nonce` (printable, no
    /// comma: [`fresh_nonce`]).
    pub fn new(mechanism: Mechanism, user: &str, password: &str, nonce: String) -> Scram {
        // RFC 5802's saslname: "=" and "," escaped.
        let name = user.replace('=', "=3D").replace(',', "=2C");
        Scram {
            sha512: mechanism == Mechanism::ScramSha512,
            password: password.to_string(),
            first_bare: format!("n={name},r={nonce}"),
            nonce,
            server_proof: None,
        }
    }

    /// The client's first message (no channel binding).
    pub fn first(&self) -> Vec<u8> {
        format!("n,,{}", self.first_bare).into_bytes()
    }

    /// The client's final message, from the server's first; keeps what the
    /// server's final must prove.
    pub fn reply(&mut self, server_first: &[u8]) -> Result<Vec<u8>, String> {
        let text =
            std::str::from_utf8(server_first).map_err(|_| "the server's SCRAM message is not UTF-8")?;
        let field = |name: &str| {
            text.split(',')
                .find_map(|f| f.strip_prefix(name))
                .ok_or(format!("the server's SCRAM message has no {name}"))
        };
        let nonce = field("r=")?;
        if !nonce.starts_with(&self.nonce) || nonce.len() == self.nonce.len() {
            return Err("the server's SCRAM nonce does not extend the client's".into());
        }
        let salt = STANDARD.decode(field("s=")?).map_err(|_| "the server's SCRAM salt is not base64")?;
        let iterations: u32 =
            field("i=")?.parse().map_err(|_| "the server's SCRAM iteration count is not a number")?;
        if !(1..=MAX_ITERATIONS).contains(&iterations) {
            return Err(format!(
                "the server asks for {iterations} SCRAM iterations; at most {MAX_ITERATIONS} are done"
            ));
        }
        let (algorithm, mac, length) = if self.sha512 {
            (pbkdf2::PBKDF2_HMAC_SHA512, hmac::HMAC_SHA512, 64)
        } else {
            (pbkdf2::PBKDF2_HMAC_SHA256, hmac::HMAC_SHA256, 32)
        };
        let mut salted = vec![0u8; length];
        let rounds = std::num::NonZeroU32::new(iterations).expect("at least 1");
        pbkdf2::derive(algorithm, rounds, &salt, self.password.as_bytes(), &mut salted);
        let salted = hmac::Key::new(mac, &salted);
        let client_key = hmac::sign(&salted, b"Client Key");
        let stored_key = digest::digest(mac.digest_algorithm(), client_key.as_ref());
        let without_proof = format!("c=biws,r={nonce}");
        let auth_message = format!("{},{text},{without_proof}", self.first_bare);
        let signature = hmac::sign(&hmac::Key::new(mac, stored_key.as_ref()), auth_message.as_bytes());
        let proof: Vec<u8> = client_key.as_ref().iter().zip(signature.as_ref()).map(|(k, s)| k ^ s).collect();
        let server_key = hmac::sign(&salted, b"Server Key");
        self.server_proof = Some((hmac::Key::new(mac, server_key.as_ref()), auth_message));
        Ok(format!("{without_proof},p={}", STANDARD.encode(proof)).into_bytes())
    }

    /// Checks the server's final message: it proves the server knew the
    /// password, or says why the server refused.
    pub fn verify(&self, server_final: &[u8]) -> Result<(), String> {
        let text = String::from_utf8_lossy(server_final);
        if let Some(error) = text.strip_prefix("e=") {
            return Err(format!(
                "the server refused the SCRAM authentication: {}",
                super::super::errors::broker_text(error)
            ));
        }
        let (key, message) = self.server_proof.as_ref().ok_or("no SCRAM reply was sent")?;
        let given = text.strip_prefix("v=").and_then(|v| STANDARD.decode(v.trim()).ok());
        match given {
            Some(signature) if hmac::verify(key, message.as_bytes(), &signature).is_ok() => Ok(()),
            _ => Err("the server's SCRAM signature is wrong: it does not know the password".into()),
        }
    }
}

/// A fresh client nonce: 122 random bits from the OS (a v4 UUID), in
/// base64.
pub fn fresh_nonce() -> String {
    STANDARD.encode(uuid::Uuid::new_v4().as_bytes()).trim_end_matches('=').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scram_sha_256_matches_rfc_7677() {
        let mut scram = Scram::new(Mechanism::ScramSha256, "user", "pencil", "rOprNGfwEbeRWgbNEkqO".into());
        assert_eq!(scram.first(), b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO");
        let server_first =
            b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096";
        let reply = scram.reply(server_first).unwrap();
        assert_eq!(
            String::from_utf8(reply).unwrap(),
            "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,\
             p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
        );
        scram.verify(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=").unwrap();
        let forged = scram.verify(b"v=AAAATRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=").unwrap_err();
        assert!(forged.contains("does not know the password"), "{forged}");
    }

    #[test]
    fn a_hostile_server_first_message_is_refused() {
        let nonce = "abc".to_string();
        for (server_first, why) in [
            (&b"r=xyz,s=c2FsdA==,i=4096"[..], "does not extend"),
            (b"r=abc,s=c2FsdA==,i=4096", "does not extend"),
            (b"r=abcdef,s=!!,i=4096", "not base64"),
            (b"r=abcdef,s=c2FsdA==,i=100000000", "at most 16384"),
            (b"r=abcdef,s=c2FsdA==,i=0", "at most"),
            (b"r=abcdef,s=c2FsdA==", "no i="),
            (b"\xff", "not UTF-8"),
        ] {
            let mut scram = Scram::new(Mechanism::ScramSha512, "u", "p", nonce.clone());
            let error = scram.reply(server_first).unwrap_err();
            assert!(error.contains(why), "{error}");
        }
        let scram = Scram::new(Mechanism::ScramSha512, "u", "p", nonce);
        assert!(scram.verify(b"e=invalid-proof\n").unwrap_err().contains("invalid-proof\\n"));
    }

    #[test]
    fn the_mechanisms_are_the_settings_choices_in_its_order() {
        let Some(crate::guc::Declared { kind: crate::guc::Kind::Choice(names), .. }) =
            crate::guc::declared("outbox.kafka_sasl_mechanism")
        else {
            panic!("outbox.kafka_sasl_mechanism is a choice")
        };
        let ours: Vec<String> = Mechanism::ALL.iter().map(|m| m.name().to_lowercase()).collect();
        assert_eq!(ours, *names);
    }

    #[test]
    fn names_and_nonces_are_safe_to_send() {
        let scram = Scram::new(Mechanism::ScramSha256, "a=b,c", "p", fresh_nonce());
        let first = String::from_utf8(scram.first()).unwrap();
        assert!(first.starts_with("n,,n=a=3Db=2Cc,r="), "{first}");
        assert_eq!(first.matches(',').count(), 3, "{first}");
        assert_ne!(fresh_nonce(), fresh_nonce());
        assert_eq!(plain("u", "p"), b"\0u\0p");
    }
}
