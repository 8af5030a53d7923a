# preflight coordinator image. It only needs Python and paramiko: every tool a check runs (iperf3, dd, ...)
# runs on the hosts. It runs as root inside the container so that a read-only mounted ~/.ssh (0600 keys) and
# the ssh-agent socket are readable; see the README's "Container" section for the one documented way to run it.
FROM python:3.12-slim

WORKDIR /src
COPY pyproject.toml README.md hostfile.example ./
COPY preflight ./preflight
RUN pip install --no-cache-dir . && rm -rf /src

# No USER: the image's default, root, reads the mounted keys and agent socket whatever their owner's uid.
WORKDIR /w
ENTRYPOINT ["preflight"]
CMD ["--help"]
