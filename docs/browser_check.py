"""Open the built documentation in headless Chromium and check it.

  python docs/browser_check.py docs/_build/html

Fails (exit status 1) on a broken internal link anywhere in the site (a missing page
or a missing #anchor) and on a JavaScript error in the pages it opens: the home page,
an API page and a guide. Saves a screenshot of each opened page to
``<build>/../screenshots/``. Needs Chromium and its driver (Debian: ``apt-get install
chromium chromium-driver``) and ``selenium``.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlparse

# The pages opened in the browser, relative to the build directory.
PAGES = {
    "home": "index.html",
    "api": "api/generated/accum_jax.accumulate.html",
    "guide": "token_weighting.html",
    "executed": "getting_started.html",
}


class _Links(HTMLParser):
  def __init__(self):
    super().__init__()
    self.links: list[str] = []
    self.ids: set[str] = set()

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if "id" in attrs:
      self.ids.add(attrs["id"])
    if tag == "a" and "name" in attrs:
      self.ids.add(attrs["name"])
    for key in ("href", "src"):
      if attrs.get(key) and tag in ("a", "img", "link", "script"):
        self.links.append(attrs[key])


@functools.cache
def _parse(path: Path) -> _Links:
  parser = _Links()
  parser.feed(path.read_text(errors="replace"))
  return parser


def broken_links(root: Path) -> list[str]:
  """Internal links of every page under ``root`` whose file or anchor is missing."""
  broken = []
  for page in sorted(root.rglob("*.html")):
    if page.relative_to(root).parts[0] == "_static":
      continue  # the theme's own template fragments, not pages
    for link in _parse(page).links:
      parsed = urlparse(link)
      if parsed.scheme or link.startswith(("//", "mailto:", "javascript:")):
        continue  # external: not checked offline
      target, anchor = urldefrag(link)
      target = urlparse(target).path  # without "?v=..." cache busters
      path = (page.parent / unquote(target)).resolve() if target else page
      if path.is_dir():
        path = path / "index.html"
      where = f"{page.relative_to(root)} -> {link}"
      if not path.exists():
        broken.append(f"{where}: no such file")
      elif anchor and path.suffix == ".html" and unquote(anchor) not in _parse(path).ids:
        broken.append(f"{where}: no such anchor")
  return broken


def _serve(root: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
  handler = functools.partial(_QuietHandler, directory=str(root))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  return server, f"http://127.0.0.1:{server.server_address[1]}/"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args):
    pass


def browse(root: Path, screenshots: Path) -> list[str]:
  """Opens ``PAGES`` in headless Chromium; returns the problems seen."""
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service

  options = webdriver.ChromeOptions()
  for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
              "--window-size=1280,1400", "--disable-gpu"):
    options.add_argument(arg)
  options.binary_location = "/usr/bin/chromium"
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
  server, base = _serve(root)
  problems = []
  screenshots.mkdir(parents=True, exist_ok=True)
  try:
    for name, page in PAGES.items():
      url = urljoin(base, page)
      driver.get(url)
      title = driver.title
      if not title or "404" in title or "Error" in title:
        problems.append(f"{page}: the page did not load (title {title!r})")
      # A script that threw is logged as SEVERE; so is a resource that failed to load.
      for entry in driver.get_log("browser"):
        # The browser asks for /favicon.ico by itself; the site declares none.
        if entry["level"] == "SEVERE" and "favicon.ico" not in entry["message"]:
          problems.append(f"{page}: {entry['message']}")
      broken_images = driver.execute_script(
          "return Array.from(document.images)"
          ".filter(img => !img.complete || img.naturalWidth === 0).map(img => img.src);"
      )
      problems += [f"{page}: image did not load: {src}" for src in broken_images]
      if name == "executed":  # show the figure the executed code drew
        driver.execute_script(
            "const img = document.querySelector('.cell_output img');"
            "if (!img) { throw new Error('no figure in the executed page'); }"
            "img.scrollIntoView({block: 'center'});"
        )
      out = screenshots / f"{name}.png"
      driver.save_screenshot(str(out))
      print(f"{page}: {title!r}, screenshot {out}")
  finally:
    driver.quit()
    server.shutdown()
  return problems


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("build", type=Path, help="the HTML build directory")
  parser.add_argument("--screenshots", type=Path, help="default: <build>/../screenshots")
  args = parser.parse_args(argv)
  root = args.build.resolve()
  screenshots = args.screenshots or root.parent / "screenshots"
  problems = [f"broken link: {b}" for b in broken_links(root)]
  problems += browse(root, screenshots)
  for problem in problems:
    print(f"FAIL {problem}", file=sys.stderr)
  print(f"{len(list(root.rglob('*.html')))} pages checked for links;"
        f" {len(PAGES)} opened in Chromium; {len(problems)} problem(s)")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
