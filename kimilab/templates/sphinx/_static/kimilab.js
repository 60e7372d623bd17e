// kimilab's web edition: every section whose heading says "Deep dive" is folded into a closed
// <details>, its heading the summary, so a chapter's core path reads straight through.
// Without JavaScript the deep dives simply show in full.
document.addEventListener("DOMContentLoaded", () => {
  for (const section of document.querySelectorAll(".bd-article section")) {
    const heading = section.querySelector(":scope > h1, :scope > h2, :scope > h3, :scope > h4, :scope > h5");
    if (!heading || !/deep dive/i.test(heading.textContent)) continue;
    const details = document.createElement("details");
    details.className = "deep-dive";
    const summary = document.createElement("summary");
    summary.appendChild(heading);  // the heading keeps its anchor and permalink
    details.appendChild(summary);
    while (section.firstChild) details.appendChild(section.firstChild);
    section.appendChild(details);
    // A link to an anchor inside a deep dive opens it.
    if (location.hash && details.querySelector(CSS.escape ? "#" + CSS.escape(location.hash.slice(1)) : location.hash))
      details.open = true;
  }
  window.addEventListener("hashchange", () => {
    const target = document.getElementById(decodeURIComponent(location.hash.slice(1)));
    const fold = target && target.closest("details.deep-dive");
    if (fold) { fold.open = true; target.scrollIntoView(); }
  });
});
