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

HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"]

# uvicorn drains in-flight requests on SIGTERM (CACHESEEK_GRACEFUL_TIMEOUT_SECONDS, default 30 s).
STOPSIGNAL SIGTERM
CMD ["cacheseek", "serve", "--host", "0.0.0.0"]
