// The only script of the dashboard besides htmx. Ask before destructive form posts.
// Forms carry data-confirm="question"; without JavaScript the same actions have their own
// confirmation page or are harmless to repeat.
document.addEventListener("submit", function (event) {
  var question = event.target.getAttribute && event.target.getAttribute("data-confirm");
  if (question && !window.confirm(question)) {
    event.preventDefault();
    event.stopImmediatePropagation();
  }
}, true);

// Polled blocks (a batch page's live block, the list's rows of running batches) poll their
// URL every few seconds (hx-trigger: the server spreads the period per page). While the
// answers show the same version of the batch (data-poll-version), the page lets ticks
// pass: it waits as long as the version had been unchanged at the previous poll, up to
// data-poll-max seconds (2, 4, 8, 16, 30 s apart for a batch that does not move), and polls
// on every tick again once a new version shows. The URL stays the same, so each poll sends
// back the ETag of the copy shown and an unchanged batch costs the server a 304.
var polledBlocks = {};  // by polling URL: the version shown, since when, the last poll
document.addEventListener("htmx:confirm", function (event) {
  var block = event.detail.elt;
  var version = block.getAttribute("data-poll-version");
  if (!version || event.detail.verb !== "get") {
    return;
  }
  var url = block.getAttribute("hx-get");
  var every = /every ([0-9.]+)s/.exec(block.getAttribute("hx-trigger") || "");
  var tick = every ? parseFloat(every[1]) : 2;
  var now = Date.now() / 1000;
  var seen = polledBlocks[url];
  if (!seen || seen.version !== version) {
    // A version shown for the first time: it came with the answer one tick ago.
    polledBlocks[url] = {version: version, since: now - tick, last: now};
    return;
  }
  var wait = Math.min(parseFloat(block.getAttribute("data-poll-max")), seen.last - seen.since);
  if (now - seen.last < wait - tick / 2) {
    event.preventDefault();  // not due yet: htmx skips this tick
    return;
  }
  seen.last = now;
});
