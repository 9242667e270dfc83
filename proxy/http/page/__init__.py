"""The live page's static files (index.html, page.js, page.css), served by admin.py."""
