// The jobs page: submit a job, see the account's jobs live (state, place, estimated wait, progress,
// preview, images) and cancel, pause or resume them. REST for the list and the actions, /ws/jobs/ for
// the events (docs/protocol.md, "For the people who use it"). Plain JS, no build step.
"use strict";

(function () {
  const root = document.getElementById("jobs");
  const $ = (id) => document.getElementById(id);
  const form = $("submit");
  const rows = $("job-rows");
  const feed = $("feed");
  const errorLine = $("job-error");
  const csrf = form.querySelector("input[name=csrfmiddlewaretoken]").value;

  const BACKOFF_FIRST_MS = 500;
  const BACKOFF_MAX_MS = 15000;
  const STABLE_MS = 10000; // a socket open this long proved itself: a later drop starts the backoff afresh
  const LIST_PAGE = "/api/v1/jobs/";
  const ENDED = new Set(["succeeded", "failed", "cancelled"]);
  const STATE_WORDS = {
    queued: "Queued",
    dispatched: "Sent to a GPU",
    running: "Running",
    paused: "Paused",
    succeeded: "Done",
    failed: "Failed",
    cancelled: "Cancelled",
  };
  const FINAL_CLOSES = { 4001: "You are logged out: log in again to follow your jobs." };

  const jobs = new Map(); // id -> the latest job representation
  const previews = new Map(); // id -> the latest preview (never stored anywhere else)
  let socket = null;
  // Started afresh only once a socket stayed open STABLE_MS (reconnect.js): the feed may carry no
  // message for long, so a message is no sign; and a bare open is none either (a server that accepts
  // and drops at once would be retried without pause).
  const backoff = window.potocolomReconnect.Backoff(BACKOFF_FIRST_MS, BACKOFF_MAX_MS);
  let stableTimer = null;

  // --- rendering -----------------------------------------------------------------------------

  function words(seconds) {
    if (seconds < 1) return "under a second";
    if (seconds < 90) return Math.round(seconds) + " s";
    return Math.round(seconds / 60) + " min";
  }

  function stateText(job) {
    let text = STATE_WORDS[job.state] || job.state;
    if (job.state === "queued" && job.position) text += ": number " + job.position + " in line";
    if (job.state === "queued" && typeof job.eta_seconds === "number") text += ", starts in about " + words(job.eta_seconds);
    if (job.state === "failed" && job.error) text += ": " + job.error;
    return text;
  }

  function button(label, action, job) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.className = "action-" + action;
    b.addEventListener("click", () => act(job.id, action));
    return b;
  }

  function cell(row, className) {
    const td = document.createElement("td");
    td.className = className;
    row.appendChild(td);
    return td;
  }

  function render(job) {
    let row = document.getElementById("job-" + job.id);
    if (row === null) {
      row = document.createElement("tr");
      row.id = "job-" + job.id;
      row.dataset.created = job.created_at || "";
      const newer = Array.from(rows.children).find((r) => r.dataset.created < row.dataset.created);
      rows.insertBefore(row, newer || null);
    }
    row.dataset.state = job.state;
    row.replaceChildren();
    cell(row, "job-id").textContent = job.id.slice(0, 8);
    cell(row, "job-model").textContent = job.model_id;
    cell(row, "job-prompt").textContent = (job.params && job.params.prompt) || "";
    cell(row, "job-state").textContent = stateText(job);

    const progress = cell(row, "job-progress");
    if (job.progress && job.progress.steps) {
      const bar = document.createElement("progress");
      bar.max = job.progress.steps;
      bar.value = job.progress.step;
      progress.append(bar, " " + job.progress.step + "/" + job.progress.steps);
    }
    if (previews.has(job.id) && !ENDED.has(job.state)) {
      const img = document.createElement("img");
      img.className = "preview";
      img.alt = "preview";
      img.src = previews.get(job.id);
      progress.appendChild(img);
    }

    const images = cell(row, "job-images");
    for (const url of job.images || []) {
      const a = document.createElement("a");
      a.href = url;
      a.target = "_blank";
      const img = document.createElement("img");
      img.className = "thumb";
      img.alt = "image of job " + job.id.slice(0, 8);
      img.src = url;
      a.appendChild(img);
      images.appendChild(a);
    }

    const actions = cell(row, "job-actions");
    if (["queued", "dispatched", "running"].includes(job.state)) actions.appendChild(button("Pause", "pause", job));
    if (job.state === "paused") actions.appendChild(button("Resume", "resume", job));
    if (!ENDED.has(job.state)) actions.appendChild(button("Cancel", "cancel", job));
    $("no-jobs").hidden = jobs.size > 0;
  }

  // Events arrive in order, but a REST answer may have been read before an event that reached the
  // page first (a submission's answer after its "running", a pause's after its "paused"): a REST
  // answer is shown only when no event of that job came while it was on its way.
  let events = 0; // events received so far
  const lastEvent = new Map(); // job id -> the count when its latest event came

  function update(job, sentAt) {
    if (sentAt === undefined) {
      events += 1;
      lastEvent.set(job.id, events);
    } else if ((lastEvent.get(job.id) || 0) > sentAt) {
      return;
    }
    jobs.set(job.id, job);
    if (ENDED.has(job.state)) previews.delete(job.id);
    render(job);
  }

  function progressed(message) {
    const job = jobs.get(message.job_id);
    if (job === undefined) return; // not listed yet: the next list fetch shows it
    job.progress = { step: message.step, steps: message.steps };
    if (message.preview) previews.set(message.job_id, message.preview);
    render(job);
  }

  // --- REST ----------------------------------------------------------------------------------

  async function api(method, url, body) {
    const response = await fetch(url, {
      method: method,
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrf, Accept: "application/json" },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    let payload = null;
    try {
      payload = await response.json();
    } catch (err) {
      payload = null;
    }
    return { ok: response.ok, status: response.status, payload: payload };
  }

  async function loadList() {
    const sentAt = events;
    const answer = await api("GET", LIST_PAGE);
    if (!answer.ok || !answer.payload) return;
    for (const job of answer.payload.results.slice().reverse()) update(job, sentAt);
  }

  async function act(id, action) {
    errorLine.textContent = "";
    const sentAt = events;
    const answer = await api("POST", "/api/v1/jobs/" + id + "/" + action + "/");
    if (answer.ok) {
      update(answer.payload, sentAt);
    } else {
      errorLine.textContent = "Could not " + action + " the job: " + explain(answer);
    }
  }

  function explain(answer) {
    const p = answer.payload;
    if (p === null) return "the server answered " + answer.status + ".";
    if (typeof p.detail === "string") return p.detail;
    if (p.detail && typeof p.detail === "object") {
      return Object.entries(p.detail).map(([field, messages]) =>
        (field === "non_field_errors" ? "" : field + ": ") + [].concat(messages).join(" ")).join("; ");
    }
    return p.error || "the server answered " + answer.status + ".";
  }

  function submission() {
    const params = { prompt: $("job-prompt").value };
    for (const name of ["width", "height", "steps", "seed"]) {
      const value = $("job-" + name).value;
      if (value !== "") params[name] = Number(value);
    }
    const body = { params: params };
    const model = $("job-model").value;
    if (model.startsWith("tier:")) body.tier = model.slice(5);
    else if (model !== "") body.model_id = model;
    return body;
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    errorLine.textContent = "";
    if ($("job-prompt").value.trim() === "") {
      errorLine.textContent = "Write a prompt first.";
      return;
    }
    const sentAt = events;
    const answer = await api("POST", LIST_PAGE, submission());
    if (answer.ok) {
      update(answer.payload, sentAt);
    } else {
      errorLine.textContent = "The job was not taken: " + explain(answer);
    }
  });

  // --- the events socket ---------------------------------------------------------------------

  function connect() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const sock = new WebSocket(scheme + "//" + location.host + root.dataset.socket);
    socket = sock;
    sock.addEventListener("open", () => {
      stableTimer = setTimeout(backoff.live, STABLE_MS);
      feed.textContent = "Following your jobs live.";
      feed.className = "status live";
      loadList(); // what changed while the socket was away
    });
    sock.addEventListener("message", (event) => {
      let message;
      try {
        message = JSON.parse(event.data);
      } catch (err) {
        return;
      }
      if (message.type === "job" && message.job) update(message.job);
      else if (message.type === "job_progress") progressed(message);
    });
    sock.addEventListener("close", (event) => {
      if (sock !== socket) return;
      socket = null;
      clearTimeout(stableTimer);
      if (event.code in FINAL_CLOSES) {
        feed.textContent = FINAL_CLOSES[event.code];
        feed.className = "status closed";
        return;
      }
      const delay = backoff.next();
      feed.textContent = "Live updates lost: reconnecting in " + (delay / 1000).toFixed(1) + " s…";
      feed.className = "status closed";
      setTimeout(connect, delay);
    });
  }

  loadList();
  connect();
})();
