// The console's fleet view: every node of the fleet side by side, the
// fleet's totals, and the operator's fleet-wide acts (docs/console.md, "The
// fleet").
//
// Reads /queue-state?scope=cluster and /accounting?scope=cluster every 2 s.
// A 200 carries each node's own figures (trust.nodes) and each node's books
// (by_node); a 503 names the nodes that are missing, late or not vouching
// and carries no summed counts (never a partial sum), so the view then
// shows "not summed", no totals, and those nodes marked; each node that did
// answer still shows its own figures (own_figures) and books, side by side.
// Both answers list the nodes on the node list that are not live
// (trust.down: lapsed or left), so a node down before this page opened is
// shown from the first draw; a node forgotten is on no list and not shown.
// Only when the list could not be read (trust.down null) does a node this
// page saw stay as a row, "gone". A node outside a fleet (SQLite) answers as
// a fleet of one, and the view shows that one node.
//
// Posts: /admin/pause and /admin/resume with {"node": NAME} (that node,
// asked through this one) or {"route": R} (every node's), and
// /admin/run-now with {"route": R} or {"job": J}, after a confirm step.
// Helpers, the token among them, come from console.js (loaded first).
"use strict";

(function () {
  const REFRESH_MS = 2000;
  const MESSAGE = "fleet-message";

  const seen = new Set(); // every node this page has seen on the node list
  let pending = null; // the run-now awaiting its confirm: {kind, value}

  function ui() {
    return window.QueueNodeConsole;
  }

  // -- one node's row ------------------------------------------------------------------

  // "down" / "not vouching" / "not summed" for a node a 503 names: the
  // 503's reason when it names this node, else the node's own (the error
  // of a node that gave no answer).
  function missingState(name, reason, node) {
    const own = typeof reason === "string" && reason.startsWith("node " + name + " ");
    let why;
    if (own) {
      why = reason.slice(reason.indexOf(": ") + 2);
    } else if (node && node.own_figures === false && node.reason) {
      why = node.reason;
    } else {
      return ["not-summed", "not summed (see the reason above)"];
    }
    if (why.startsWith("does not vouch")) {
      return ["not-vouching", why];
    }
    if (why.startsWith("cannot be reached") || why.startsWith("no answer")) {
      return ["down", "down: " + why];
    }
    return ["not-summed", why];
  }

  function pausedText(paused) {
    if (!paused) {
      return "–";
    }
    const parts = [];
    if (paused.node) {
      parts.push("node");
    }
    if (paused.routes && paused.routes.length) {
      parts.push("routes " + paused.routes.join(", "));
    }
    return parts.length ? parts.join("; ") : "no";
  }

  function lawText(gap) {
    if (gap === null || gap === undefined) {
      return "–";
    }
    return gap === 0 ? "balanced (0)" : "off by " + gap;
  }

  function nodeButton(td, label, verb, name) {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = label;
    button.dataset.testid = "fleet-" + verb;
    button.addEventListener("click", () => pauseNode(verb, name));
    td.appendChild(button);
  }

  // A node on the list that is not live (trust.down): "down" when it
  // lapsed (no heartbeat within the membership timeout), "left" when it
  // left cleanly.
  function downRow(entry) {
    const age = Math.round(entry.heartbeat_age_s || 0).toLocaleString("en-US") + " s";
    if (entry.state === "left") {
      return nodeRow(entry.name, { address: entry.address }, null, "left",
        "left the fleet (last heartbeat " + age + " ago)");
    }
    return nodeRow(entry.name, { address: entry.address }, null, "down",
      "down: no heartbeat for " + age + " (off the live node list)", false);
  }

  function nodeRow(name, node, books, state, stateText, buttons) {
    const { cell } = ui();
    const tr = document.createElement("tr");
    tr.dataset.testid = "fleet-node";
    tr.dataset.node = name;
    tr.dataset.state = state;
    tr.className = state;
    cell(tr, name, "key");
    cell(tr, node.address);
    cell(tr, stateText, state === "vouched" ? "" : "error").dataset.testid = "fleet-node-state";
    cell(tr, node.due).dataset.testid = "fleet-node-due";
    cell(tr, node.rows);
    cell(tr, node.in_flight).dataset.testid = "fleet-node-in-flight";
    cell(tr, node.unclaimed);
    cell(tr, pausedText(node.paused)).dataset.testid = "fleet-node-paused";
    cell(tr, Array.isArray(node.lateness) ? node.lateness.join(" · ") : null);
    const gaps = (books && books.gaps) || {};
    const input = gaps.input !== undefined ? gaps.input : node.input_gap;
    cell(tr, lawText(input)).dataset.testid = "fleet-node-input-law";
    cell(tr, lawText(gaps.output)).dataset.testid = "fleet-node-output-law";
    const td = cell(tr, null);
    td.textContent = "";
    if (buttons !== false && state !== "gone" && state !== "left") {
      nodeButton(td, "Pause", "pause", name);
      nodeButton(td, "Resume", "resume", name);
    }
    return tr;
  }

  // -- the view ------------------------------------------------------------------------

  // A fleet of one (a node outside a fleet) has no trust.nodes: its own
  // document is its one node's figures.
  function nodesOf(state) {
    const trust = state.trust || {};
    if (trust.nodes) {
      return trust.nodes;
    }
    const now = state.now || {};
    const out = {};
    for (const name of state.nodes || []) {
      out[name] = {
        vouched: trust.vouched, reason: trust.reason, address: location.host,
        due: (now.due || {}).total, rows: now.rows, in_flight: now.in_flight,
        unclaimed: now.unclaimed, paused: now.paused,
        lateness: (state.lateness || {}).total,
        input_gap: (state.counters || {}).input_gap,
      };
    }
    return out;
  }

  // A 503 of the books carries, in by_node, the books of each node that
  // answered (each by itself, not summed).
  function booksOf(books) {
    if (!books) {
      return {};
    }
    if (books.by_node) {
      return books.by_node;
    }
    if (books.error) {
      return {};
    }
    const out = {};
    for (const name of books.nodes || []) {
      out[name] = { balanced: books.balanced, gaps: books.gaps };
    }
    return out;
  }

  function renderTotals(state, books, summed) {
    const { byId, fmt } = ui();
    const now = summed ? state.now || {} : {};
    byId("fleet-due").textContent = fmt((now.due || {}).total);
    byId("fleet-rows").textContent = fmt(now.rows);
    byId("fleet-in-flight").textContent = fmt(now.in_flight);
    byId("fleet-unclaimed").textContent = fmt(now.unclaimed);
    byId("fleet-parked").textContent = fmt(now.parked);
    const lateness = summed ? (state.lateness || {}).total : null;
    byId("fleet-lateness").textContent = Array.isArray(lateness) ? lateness.join(" · ") : "–";
    byId("fleet-paused-routes").textContent = summed
      ? ((now.paused || {}).routes || []).join(", ") || "none" : "–";
    const badge = byId("fleet-balanced");
    if (books && !books.error && typeof books.balanced === "boolean") {
      const gaps = books.gaps || {};
      badge.textContent = (books.balanced ? "balanced" : "NOT balanced")
        + " (input " + fmt(gaps.input) + ", output " + fmt(gaps.output) + ")";
      badge.className = "badge " + (books.balanced ? "ok" : "bad");
    } else {
      badge.textContent = "books not summed";
      badge.className = "badge bad";
    }
  }

  function render(stateAnswer, booksAnswer) {
    const { byId, tbody, errorText } = ui();
    const state = stateAnswer.body || {};
    const trust = state.trust || {};
    const summed = stateAnswer.status === 200 && trust.vouched !== false;
    const summary = byId("fleet-summary");
    const names = state.nodes || [];
    if (summed) {
      summary.textContent = "summed over " + names.length + " node"
        + (names.length === 1 ? "" : "s") + ": " + names.join(", ");
      summary.className = "ok";
    } else {
      const reason = trust.reason || errorText(stateAnswer);
      summary.textContent = "not summed: " + reason;
      summary.className = "bad";
    }
    summary.dataset.summed = summed ? "true" : "false";
    const books = booksAnswer.body;
    renderTotals(state, books, summed);
    const nodes = nodesOf(state);
    const byNode = booksOf(books);
    const missing = new Set(trust.missing || []);
    const down = Array.isArray(trust.down) ? trust.down : null;
    const rows = [];
    for (const name of Object.keys(nodes)) {
      seen.add(name);
      const node = nodes[name];
      let kind = "vouched";
      let text = "vouched";
      if (missing.has(name)) {
        [kind, text] = missingState(name, trust.reason, node);
      } else if (!summed && missing.size === 0) {
        [kind, text] = ["not-vouching", "does not vouch: " + (trust.reason || "")];
      } else if (!summed) {
        [kind, text] = ["waiting", "answered (not summed: another node is missing)"];
      } else if (!node.vouched) {
        [kind, text] = ["not-vouching", "does not vouch: " + (node.reason || "")];
      }
      // In a 503 a node that answered shows its own figures, never a sum.
      const figures = summed || node.own_figures ? node : { address: node.address };
      rows.push([name, () => nodeRow(name, figures, byNode[name], kind, text)]);
    }
    for (const entry of down || []) {
      if (!(entry.name in nodes)) {
        seen.add(entry.name);
        rows.push([entry.name, () => downRow(entry)]);
      }
    }
    if (down === null) {
      // The node list was not read (or this is a fleet of one): the nodes
      // this page saw and no longer sees stay, as "gone".
      for (const name of seen) {
        if (!(name in nodes)) {
          rows.push([name, () => nodeRow(name, {}, null, "gone",
            "not on the live node list: down, or left the fleet")]);
        }
      }
    }
    const body = tbody("fleet-nodes");
    rows.sort((x, y) => (x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : 0));
    for (const [, draw] of rows) {
      body.appendChild(draw());
    }
  }

  async function refreshFleet() {
    const { getJson } = ui();
    let answers;
    try {
      answers = await Promise.all([
        getJson("/queue-state?scope=cluster"),
        getJson("/accounting?scope=cluster"),
      ]);
    } catch (err) {
      return; // the node view's banner says the node does not answer
    }
    if (answers[0].status === 401) {
      return; // the node view's banner asks for the token
    }
    render(answers[0], answers[1]);
  }

  async function loop() {
    await refreshFleet();
    setTimeout(loop, REFRESH_MS);
  }

  // -- the operator's acts -------------------------------------------------------------

  async function act(path, payload, done) {
    await ui().post(path, payload, done, MESSAGE);
    refreshFleet();
  }

  function pauseNode(verb, name) {
    act("/admin/" + verb, { node: name }, (body) => (verb === "pause" ? "Paused" : "Resumed")
      + " node " + name + (body.applied ? "." : " (applied at its keeper's next state write)."));
  }

  function say(text) {
    const message = ui().byId(MESSAGE);
    message.className = "bad";
    message.textContent = text;
  }

  function routeOrJob() {
    const { byId } = ui();
    const kind = byId("fleet-run-kind").value;
    const value = byId("fleet-target").value.trim();
    if (!value) {
      say("Name the " + kind + " first.");
      return null;
    }
    return { kind: kind, value: value };
  }

  function pauseRoute(verb) {
    const { byId } = ui();
    const route = byId("fleet-target").value.trim();
    if (!route) {
      say("Name the route first.");
      return;
    }
    act("/admin/" + verb, { route: route }, () => (verb === "pause" ? "Paused" : "Resumed")
      + " route " + route + " on every node.");
  }

  function askRunNow() {
    const { byId } = ui();
    pending = routeOrJob();
    if (!pending) {
      return;
    }
    byId("fleet-confirm-text").textContent = "Make every row of " + pending.kind + " "
      + pending.value + " due now, on every node?";
    byId("fleet-confirm").hidden = false;
  }

  function confirmRunNow() {
    const { byId } = ui();
    byId("fleet-confirm").hidden = true;
    if (!pending) {
      return;
    }
    const { kind, value } = pending;
    pending = null;
    act("/admin/run-now", { [kind]: value }, (body) => body.rescheduled + " rows of " + kind
      + " " + value + " due now.");
  }

  function cancelRunNow() {
    pending = null;
    ui().byId("fleet-confirm").hidden = true;
  }

  function start() {
    const { byId } = ui();
    byId("fleet-pause-route").addEventListener("click", () => pauseRoute("pause"));
    byId("fleet-resume-route").addEventListener("click", () => pauseRoute("resume"));
    byId("fleet-run-now").addEventListener("click", askRunNow);
    byId("fleet-confirm-yes").addEventListener("click", confirmRunNow);
    byId("fleet-confirm-no").addEventListener("click", cancelRunNow);
    loop();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
