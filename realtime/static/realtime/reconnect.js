// When a page's socket tries again after a drop: full jitter over a capped exponential backoff, started
// afresh only once the connection proved itself (docs/protocol.md, "Reconnecting"). Shared by the
// drawing and jobs pages; plain JS, no build step (tests/realtime/test_reconnect_js.py runs it in node).
"use strict";

(function (exports) {
  // The wait before try number `attempt` (0: the first since the connection was last live): a random
  // time from 0 up to min(maxMs, firstMs * 2^attempt). Random, so that pages dropped together (an API
  // restart) do not all come back at the same moment; `random` is Math.random unless a test gives one.
  function reconnectDelay(attempt, firstMs, maxMs, random) {
    const cap = Math.min(maxMs, firstMs * 2 ** Math.min(attempt, 30));
    return Math.floor((random || Math.random)() * cap);
  }

  // One socket's schedule: next() gives the wait before the next try and doubles the cap for the one
  // after; live() starts afresh. Call live() when the connection proved itself (the drawing page: its
  // session is live; the jobs page: its socket stayed open STABLE_MS), never on an open or a message
  // alone, or a server that accepts and drops at once would be retried without pause.
  function Backoff(firstMs, maxMs, random) {
    let attempt = 0;
    return {
      next: function () {
        const delay = reconnectDelay(attempt, firstMs, maxMs, random);
        attempt += 1;
        return delay;
      },
      live: function () {
        attempt = 0;
      },
      attempts: function () {
        return attempt;
      },
    };
  }

  exports.reconnectDelay = reconnectDelay;
  exports.Backoff = Backoff;
})(typeof module !== "undefined" && module.exports ? module.exports : (window.potocolomReconnect = {}));
