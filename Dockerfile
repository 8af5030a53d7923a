# preflight coordinator image: SSHes into the cluster's hosts, so it needs only the SSH client and iperf3.
FROM python:3.12-slim

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends openssh-client iperf3 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md hostfile.example ./
COPY preflight ./preflight
COPY checks ./checks
RUN pip install --no-cache-dir . && useradd --create-home --uid 10001 preflight

USER 10001
WORKDIR /home/preflight
ENTRYPOINT ["preflight"]
CMD ["--help"]
