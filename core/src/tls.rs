//! TLS clients (`rediss://`, `amqps://`, `kafkas://`, the sidecar's
//! PostgreSQL): whose certificates the peer's must chain to, and the
//! client's own certificate, when it has one.

use std::path::Path;
use std::sync::Arc;

use rustls::client::ResolvesClientCert;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use rustls::SignatureScheme;

/// The TLS client configuration: the authorities of `ca_file`, or the
/// system's, and the client's certificate when `identity` is one.
/// `setting` names where the file is given, for the errors.
pub fn client_config(
    setting: &str,
    ca_file: Option<&Path>,
    identity: Option<Identity>,
) -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = roots(setting, ca_file)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some(identity) => builder.with_client_cert_resolver(identity.resolver),
    };
    Ok(Arc::new(config))
}

/// A client's certificate chain and the key it signs with.
pub struct Identity {
    pub resolver: Arc<dyn ResolvesClientCert>,
}

impl Identity {
    /// The chain (PEM) and key (PEM, unencrypted) of these files, each
    /// with the setting that names it, for the errors.
    pub fn read(
        (cert_setting, cert): (&str, &Path),
        (key_setting, key): (&str, &Path),
    ) -> Result<Identity, String> {
        let pem =
            std::fs::read(cert).map_err(|e| format!("cannot read {cert_setting} {}: {e}", cert.display()))?;
        let chain = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("unusable {cert_setting} {}: {e}", cert.display()))?;
        if chain.is_empty() {
            return Err(format!("unusable {cert_setting} {}: no certificate in it", cert.display()));
        }
        let pem =
            std::fs::read(key).map_err(|e| format!("cannot read {key_setting} {}: {e}", key.display()))?;
        let private = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
            format!("unusable {key_setting} {}: no private key in it (PEM, unencrypted): {e}", key.display())
        })?;
        Identity::of(chain, private).map_err(|e| format!("unusable {key_setting} {}: {e}", key.display()))
    }

    /// The identity of `chain` and its `key`, as ring loads the key.
    pub fn of(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<Identity, rustls::Error> {
        let signer = rustls::crypto::ring::default_provider().key_provider.load_private_key(key)?;
        Ok(Identity { resolver: Arc::new(OwnCert(Arc::new(CertifiedKey::new(chain, signer)))) })
    }
}

/// The client's certificate, sent whenever the server asks for one. As
/// libpq's, it is not parsed here: the server judges it (PostgreSQL's
/// documentation makes X.509 v1 certificates, which rustls's own resolver
/// refuses to load).
#[derive(Debug)]
struct OwnCert(Arc<CertifiedKey>);

impl ResolvesClientCert for OwnCert {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0))
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The authorities of `ca_file` (PEM), or the system's.
pub fn roots(setting: &str, ca_file: Option<&Path>) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let unusable = |e: String| format!("unusable {setting} {}: {e}", path.display());
            let pem =
                std::fs::read(path).map_err(|e| format!("cannot read {setting} {}: {e}", path.display()))?;
            for certificate in CertificateDer::pem_slice_iter(&pem) {
                roots
                    .add(certificate.map_err(|e| unusable(e.to_string()))?)
                    .map_err(|e| unusable(e.to_string()))?;
            }
            if roots.is_empty() {
                return Err(unusable("no certificate in it".into()));
            }
        }
        None => {
            let (added, _) = roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            if added == 0 {
                return Err(format!("no system certificate authorities found for TLS; set {setting}"));
            }
        }
    }
    Ok(roots)
}
