"""Paper reproductions: reported tables (experiments/<paper>/reported.csv) and the collector."""
