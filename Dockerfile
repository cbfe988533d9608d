# kvpilot control plane image: `kvpilot serve` (and `kvpilot agent`, `kvpilot` CLI).
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api api
COPY bench bench
COPY commands commands
COPY compiler compiler
COPY controlplane controlplane
COPY policies policies
COPY signals signals
COPY xdsserver xdsserver
COPY deploy deploy
RUN pip install --no-cache-dir . && useradd --system --uid 10001 kvpilot
USER 10001
# ADS (gRPC over mutual TLS) and the REST API. Mount the ADS server certificate, its key and
# the CA of the Envoys' client certificates at /etc/kvpilot/xds-tls, and bind identities to
# fleets with KVPILOT_XDS_IDENTITY_FLEETS (SAN=FLEET,...).
EXPOSE 18000 8080
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--xds-address", "0.0.0.0:18000", "--api-address", "0.0.0.0:8080", "--xds-cert", "/etc/kvpilot/xds-tls/tls.crt", "--xds-key", "/etc/kvpilot/xds-tls/tls.key", "--xds-client-ca", "/etc/kvpilot/xds-tls/ca.crt"]
