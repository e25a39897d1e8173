// Lock inspector enhancements; the page works without them.
// - Reload the list every data-refresh seconds, like the <noscript> meta refresh,
//   but hold off while locks are selected or the search and filter fields are
//   being edited, so a reload never drops a selection or half-typed text.
// - Show a "select all" checkbox.
'use strict';
{
    const list = document.querySelector('#changelist[data-refresh]');
    if (list) {
        const seconds = Number(list.dataset.refresh);
        const boxes = () => list.querySelectorAll('input.action-select');
        const anySelected = () => Array.from(boxes()).some((box) => box.checked);
        const toolbar = document.getElementById('changelist-search');
        let edited = false;
        if (toolbar) {
            toolbar.addEventListener('input', () => { edited = true; });
        }
        const editing = () => edited || Boolean(toolbar && toolbar.contains(document.activeElement));

        if (seconds > 0) {
            const tick = () => {
                if (anySelected() || editing()) {
                    window.setTimeout(tick, seconds * 1000);
                } else {
                    window.location.reload();
                }
            };
            window.setTimeout(tick, seconds * 1000);
        }

        const all = document.getElementById('select-all-locks');
        if (all) {
            all.hidden = false;
            all.addEventListener('change', () => {
                boxes().forEach((box) => { box.checked = all.checked; });
            });
            list.addEventListener('change', (event) => {
                if (event.target.classList.contains('action-select')) {
                    all.checked = Array.from(boxes()).every((box) => box.checked);
                }
            });
        }
    }
}
