// /gradient and /hvp of the served Rosenbrock from Node.js (>= 18: global fetch), JSON.
//
//     make serve &
//     node examples/fetch.mjs          # DXSERVE_URL=http://127.0.0.1:8000 by default
//
// Checks (exit status 1 on failure): the answers equal the analytic gradient and
// Hessian-vector product of Rosenbrock, computed here in plain JavaScript, to 1e-12.
const URL = process.env.DXSERVE_URL ?? "http://127.0.0.1:8000";

async function post(route, body) {
  const response = await fetch(URL + route, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  const answer = await response.json();
  // errors are application/problem+json: title, detail and the field that was wrong
  if (!response.ok) throw new Error(`${route}: ${response.status} ${answer.title}: ${answer.detail}`);
  return answer;
}

// sum 100 (x[i+1] - x[i]^2)^2 + (1 - x[i])^2: gradient and Hessian, analytic
function rosenbrockGradient(x) {
  const g = x.map(() => 0);
  for (let i = 0; i + 1 < x.length; i++) {
    const r = x[i + 1] - x[i] ** 2;
    g[i] += -400 * x[i] * r - 2 * (1 - x[i]);
    g[i + 1] += 200 * r;
  }
  return g;
}

function rosenbrockHvp(x, t) {
  const h = x.map(() => 0);
  for (let i = 0; i + 1 < x.length; i++) {
    const dii = 1200 * x[i] ** 2 - 400 * x[i + 1] + 2, dij = -400 * x[i];
    h[i] += dii * t[i] + dij * t[i + 1];
    h[i + 1] += dij * t[i] + 200 * t[i + 1];
  }
  return h;
}

function check(name, got, want) {
  const ok = got.length === want.length
    && got.every((g, i) => Math.abs(g - want[i]) <= 1e-12 * Math.max(1, Math.abs(want[i])));
  if (!ok) {
    console.error(`FAIL: ${name} ${JSON.stringify(got)}, expected ${JSON.stringify(want)}`);
    process.exit(1);
  }
}

const x = [-1.2, 1.0, 0.5, 2.0];
const t = [1.0, 0.0, -1.0, 0.5];
const { gradient } = await post("/gradient", { function: "rosenbrock", backend: "auto", x });
console.log("gradient", gradient);
check("gradient", gradient, rosenbrockGradient(x));

const backend = { type: "second-order", outer: { type: "jax-forward" }, inner: { type: "jax-reverse" } };
const { hvps } = await post("/hvp", { function: "rosenbrock", backend, x, tangents: [t] });
console.log("hvp", hvps[0]);
check("hvp", hvps[0], rosenbrockHvp(x, t));
console.log("OK");
