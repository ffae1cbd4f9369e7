// The only script of the dashboard besides htmx: ask before destructive form posts.
// Forms carry data-confirm="question"; without JavaScript the same actions have their own
// confirmation page or are harmless to repeat.
document.addEventListener("submit", function (event) {
  var question = event.target.getAttribute && event.target.getAttribute("data-confirm");
  if (question && !window.confirm(question)) {
    event.preventDefault();
    event.stopImmediatePropagation();
  }
}, true);
