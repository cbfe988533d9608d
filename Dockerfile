# kvpilot control plane image: `kvpilot serve` (and `kvpilot agent`, `kvpilot` CLI).
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api api
COPY bench bench
COPY commands commands
COPY controlplane controlplane
COPY policies policies
COPY xdsserver xdsserver
COPY deploy deploy
RUN pip install --no-cache-dir . && useradd --system --uid 10001 kvpilot
USER 10001
# ADS (gRPC) and the REST API.
EXPOSE 18000 8080
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--xds-address", "0.0.0.0:18000", "--api-address", "0.0.0.0:8080"]
