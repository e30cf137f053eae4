// The jobs list's status filter submits itself when changed (a script file: the pages' CSP runs no inline handlers).
document.querySelectorAll("select[data-submit-on-change]").forEach((select) => {
  select.addEventListener("change", () => select.form.submit());
});
