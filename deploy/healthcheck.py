#!/usr/bin/env python3
"""The image's HEALTHCHECK: exit 0 when strata answers GET /health with 200 on 127.0.0.1:$STRATA_PORT.

Stdlib only and no proxy (a proxy set in the container's environment must not answer for strata).
"""
import os
import sys
import urllib.request

port = os.environ.get("STRATA_PORT", "8000")
url = f"http://127.0.0.1:{port}/health"
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    with opener.open(url, timeout=4) as response:
        sys.exit(0 if response.status == 200 else 1)
except Exception as e:  # refused, timed out, 503 while the engine is down: all unhealthy
    print(f"{url}: {e}", file=sys.stderr)
    sys.exit(1)
