//! TLS for `rediss://`: whose certificates the broker's must chain to.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use super::secrets::read_setting_file;
use super::SinkError;

/// The TLS client configuration: the CA file's authorities, or the system's.
pub(super) fn tls_config(ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, SinkError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let unusable = |e: String| {
                SinkError::InvalidConfig(format!("unusable outbox.redis_tls_ca_file {}: {e}", path.display()))
            };
            let pem = read_setting_file("outbox.redis_tls_ca_file", path)?;
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
                return Err(SinkError::InvalidConfig(
                    "no system certificate authorities found for rediss://; set outbox.redis_tls_ca_file"
                        .into(),
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| SinkError::InvalidConfig(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
