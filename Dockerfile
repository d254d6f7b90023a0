# CacheSeek HTTP service: `cacheseek serve` on port 8080, a CPU tier plus a disk tier in /data.
#
#   docker build -t cacheseek .
#   docker run --stop-timeout 40 -p 8080:8080 -v cacheseek-data:/data cacheseek
#
# (docker stop sends SIGKILL 10 s after SIGTERM unless told otherwise: less than the server's
# 30 s drain, CACHESEEK_GRACEFUL_TIMEOUT_SECONDS. What it acknowledged survives a kill, but
# the requests still running are cut without a word.)
#
# The server never imports torch, but the package depends on it (the embedded cache and
# RemoteCache use it), so the small CPU-only wheel is installed first.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY cacheseek ./cacheseek
COPY server ./server
RUN pip install ".[server,redis]" && rm -rf /src

RUN useradd --system --uid 10001 --home-dir /data --create-home cacheseek
USER cacheseek
WORKDIR /data

ENV CACHESEEK_HOST=0.0.0.0 \
    CACHESEEK_PORT=8080 \
    CACHESEEK_DISK_PATH=/data/store
VOLUME ["/data"]
EXPOSE 8080

# It asks the port and scheme of the settings (CACHESEEK_PORT, CACHESEEK_TLS_CERT): give them
# as variables, not flags, for it to follow. (Its own process: the certificate is not checked.)
# The port opens once the disk index is rebuilt (minutes over millions of blocks): failures
# in the first 10 minutes do not count, as the Kubernetes startup probe allows (a success
# ends that period at once); 20 s made a large restart unhealthy, and Swarm restart it again.
HEALTHCHECK --interval=15s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, ssl, sys, urllib.request as r; tls = bool(os.environ.get('CACHESEEK_TLS_CERT')); url = ('https' if tls else 'http') + '://127.0.0.1:' + os.environ.get('CACHESEEK_PORT', '8080') + '/healthz'; sys.exit(0 if r.urlopen(url, timeout=2, context=ssl._create_unverified_context() if tls else None).status == 200 else 1)"]

# uvicorn drains in-flight requests on SIGTERM (CACHESEEK_GRACEFUL_TIMEOUT_SECONDS, default 30 s).
STOPSIGNAL SIGTERM
CMD ["cacheseek", "serve", "--host", "0.0.0.0"]
