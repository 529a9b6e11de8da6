"""`/dashboard`: a live page of the fleet (models, queues, workers, recent jobs, batches).

One reader per gateway process (`hub.DashboardHub`) reads Redis every
GENQ_DASHBOARD_INTERVAL_S while at least one viewer is connected, and every viewer's single
SSE stream (`/dashboard/events`) gets the sections that changed since what it was last sent,
each encoded once for all viewers: twenty viewers cost Redis what one does.

Auth (when API keys are set): the page's HTML, script and style hold no data and are served to
anyone; the data needs an admin key (GENQ_ADMIN_KEYS). A browser's EventSource cannot send a
header, and a key in a URL ends up in proxies' logs and the browser's history, so the page's
login form POSTs the key (JSON body) to `/dashboard/login`, which answers with a cookie
scoped to /dashboard (HttpOnly, SameSite=Strict, Secure over https). The cookie holds a
digest of the key, not the key: it opens the dashboard only, never the API. Scripts and tools
may send the key as a header instead (`Authorization: Bearer`, `X-API-Key`).
"""
