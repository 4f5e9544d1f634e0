//! TLS to the server, with rustls: whose certificates the server's must
//! chain to (`sslrootcert`: a file, or the system's), whether its name is
//! checked (`verify-ca` does not; every other mode that uses TLS does),
//! the client's certificate (`sslcert`, `sslkey`), the versions and SNI.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

use outbox_core::tls::Identity;

use super::options::{ClientCert, Options, Roots, SslMode};
use crate::private_file::{self, Rule};

/// The TLS client configuration `options` ask for; `roots_named` names
/// where the root certificates were given, for the errors
/// (`sslrootcert`, `--tls-ca-file`).
pub fn client_config(options: &Options, roots_named: &str) -> Result<Arc<rustls::ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let roots = Arc::new(roots(&options.roots, roots_named)?);
    let webpki = WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(&provider))
        .build()
        .map_err(|e| format!("{roots_named}: {e}"))?;
    let mut versions = Vec::new();
    if options.versions.tls12 {
        versions.push(&rustls::version::TLS12);
    }
    if options.versions.tls13 {
        versions.push(&rustls::version::TLS13);
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&versions)
        .map_err(|e| format!("ssl_min_protocol_version, ssl_max_protocol_version: {e}"))?;
    let builder = match options.sslmode {
        SslMode::VerifyCa => {
            builder.dangerous().with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
        }
        _ => builder.with_webpki_verifier(webpki),
    };
    let mut config = match &options.client_cert {
        None => builder.with_no_client_auth(),
        Some(ClientCert { cert, key }) => {
            let (chain, key) = client_cert(cert, key)?;
            let identity = Identity::of(chain, key).map_err(|e| format!("sslkey: {e}"))?;
            builder.with_client_cert_resolver(identity.resolver)
        }
    };
    config.enable_sni = options.sni;
    Ok(Arc::new(config))
}

/// The authorities of a file (PEM), or the system's.
fn roots(roots: &Roots, named: &str) -> Result<rustls::RootCertStore, String> {
    match roots {
        Roots::File(path) => outbox_core::tls::roots(named, Some(path)),
        Roots::System => outbox_core::tls::roots(named, None),
    }
}

/// The client's certificate chain, and its key, read only when no one
/// else may read it (libpq's rule).
fn client_cert(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
    let pem = std::fs::read(cert).map_err(|e| format!("sslcert {}: {e}", cert.display()))?;
    let chain = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("sslcert {}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("sslcert {}: no certificate in it", cert.display()));
    }
    let text = private_file::read(key, Rule::Key, "sslkey")?;
    let key = PrivateKeyDer::from_pem_slice(text.as_bytes()).map_err(|e| {
        format!("sslkey {}: no usable private key in it (PEM, unencrypted): {e}", key.display())
    })?;
    Ok((chain, key))
}

/// `sslmode=verify-ca`: the chain is verified, the server's name is not.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // webpki verifies the chain first, then the name: an error of the
        // name alone says the chain was verified.
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
