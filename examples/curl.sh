#!/usr/bin/env bash
# /gradient and /hvp of the served Rosenbrock with plain curl, JSON in and out.
#
#     make serve &
#     bash examples/curl.sh            # DXSERVE_URL=http://127.0.0.1:8000 by default
#
# Checks (exit status 1 on failure): both answers equal the analytic gradient and
# Hessian-vector product at x = (1, 2, 3), t = (1, 0, -1), to 1e-12 (python3, no jq).
set -euo pipefail
URL="${DXSERVE_URL:-http://127.0.0.1:8000}"

post() {  # post ROUTE BODY: prints the answer; non-2xx fails (curl --fail-with-body)
  curl -sS --fail-with-body -X POST "$URL$1" -H 'content-type: application/json' -d "$2"
}

gradient=$(post /gradient '{"function": "rosenbrock", "backend": "auto", "x": [1.0, 2.0, 3.0]}')
echo "POST /gradient -> $gradient"
hvp=$(post /hvp '{"function": "rosenbrock", "backend": {"type": "second-order", "outer": {"type": "jax-forward"}, "inner": {"type": "jax-reverse"}}, "x": [1.0, 2.0, 3.0], "tangents": [[1.0, 0.0, -1.0]]}')
echo "POST /hvp      -> $hvp"

# Rosenbrock at x = (1, 2, 3): gradient (-400, 1002, -200); H = [[402, -400, 0],
# [-400, 3802, -800], [0, -800, 200]], so H (1, 0, -1) = (402, 400, -200).
python3 - "$gradient" "$hvp" <<'PY'
import json, sys
gradient = json.loads(sys.argv[1])["gradient"]
hvp = json.loads(sys.argv[2])["hvps"][0]
def close(got, want):
    return len(got) == len(want) and all(abs(g - w) <= 1e-12 * max(1.0, abs(w)) for g, w in zip(got, want))
if not close(gradient, [-400.0, 1002.0, -200.0]) or not close(hvp, [402.0, 400.0, -200.0]):
    sys.exit(f"FAIL: gradient {gradient}, hvp {hvp}")
print("OK")
PY
